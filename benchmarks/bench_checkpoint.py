"""Checkpoint save and load: time and bytes per layout, resharding loads, next to torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py [--preset 135m] [--world 2]

Each layout trains one step (so AdamW has its states), saves, and a second layout loads that checkpoint.
The peer is torch DCP (`torch.distributed.checkpoint.save/load` of a DDP model's and optimizer's
state dicts, the same tensors in fp32), run in the same processes on the same disk.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

GiB = 1024 ** 3
LAYOUTS = {
    "zero0": {"zero_optimization": {"stage": 0}},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero3": {"zero_optimization": {"stage": 3}},
    "pp2": {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},   # 135m's 9 heads do not split in 2
}


def _cfg(extra):
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "train": {"timeout_s": 300}, **extra}


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bunsan_run(rank, world, preset, save_layout, load_layout, root):
    import torch
    import bunsan
    from parity import batches, rank_slice
    from bunsan.models import Llama, get_preset
    torch.manual_seed(0)
    engine = bunsan.initialize(Llama(get_preset(preset)), _cfg(LAYOUTS[save_layout]))
    data = batches(1, 4, seq=128)[0]
    data = {k: v % engine.module.config.vocab_size for k, v in data.items()}
    engine.train_batch(rank_slice(data, engine.dp_rank, engine.dp_size))
    t0 = time.perf_counter()
    engine.save_checkpoint(root)
    save_s = time.perf_counter() - t0
    del engine
    engine = bunsan.initialize(Llama(get_preset(preset)), _cfg(LAYOUTS[load_layout]))
    t0 = time.perf_counter()
    engine.load_checkpoint(root)
    load_s = time.perf_counter() - t0
    return save_s, load_s


def dcp_run(rank, world, preset, root):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP
    from bunsan.models import Llama, get_preset
    torch.manual_seed(0)
    model = DDP(Llama(get_preset(preset)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (2, 129))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    t0 = time.perf_counter()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    save_s = time.perf_counter() - t0
    msd, osd = get_state_dict(model, opt)
    t0 = time.perf_counter()
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=root)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_s = time.perf_counter() - t0
    return save_s, load_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="135m")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--pairs", help="saving-loading layouts to run, e.g. zero0-zero0,zero3-zero0 (default: all)")
    ap.add_argument("--skip-dcp", action="store_true")
    args = ap.parse_args()
    from dist_harness import Pools
    pools = Pools()
    rows = ["| saved by | loaded by | save s | load s | checkpoint GiB |", "|---|---|---|---|---|"]
    pairs = [("zero0", "zero0"), ("zero1", "zero1"), ("zero3", "zero3"), ("pp2", "pp2"),
             ("zero3", "zero0"), ("pp2", "zero3")]
    base = tempfile.mkdtemp(prefix="bench-ckpt-")
    print(f"# bench_checkpoint {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, {os.cpu_count()} CPUs, "
          f"{args.preset}, {args.world} ranks", flush=True)
    try:
        if args.pairs:
            pairs = [tuple(p.split("-")) for p in args.pairs.split(",")]
        for save, load in pairs:
            root = os.path.join(base, f"{save}-{load}")
            res = pools.run(args.world, bunsan_run, args.world, args.preset, save, load, root, timeout=900)
            pools.discard(args.world)
            s, lo = max(r[0] for r in res), max(r[1] for r in res)
            rows.append(f"| bunsan {save} | bunsan {load} | {s:.2f} | {lo:.2f} | {_dir_bytes(root) / GiB:.3f} |")
            print(rows[-1], flush=True)
            shutil.rmtree(root)
        if not args.skip_dcp:
            root = os.path.join(base, "dcp")
            res = pools.run(args.world, dcp_run, args.world, args.preset, root, timeout=900)
            s, lo = max(r[0] for r in res), max(r[1] for r in res)
            rows.append(f"| torch DCP (DDP) | torch DCP (DDP) | {s:.2f} | {lo:.2f} | {_dir_bytes(root) / GiB:.3f} |")
    finally:
        pools.close()
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
