"""Context parallelism on CPU: bunsan CP 2 (each rank half of every row) against one process on whole rows.

Both contenders train the tiny preset (max_position_embeddings raised to the longest sequence) from the same
weights on the same rows, fp32 AdamW, through bunsan.initialize, in fresh spawned processes with one thread
per rank, one contender after another:

  single   1 process, the whole row: 2 x its tokens/s is "the ceiling" for 2 ranks
  cp2      2 processes, context_parallel.size 2: K/V all-gathered per layer, reduce-scattered in backward

tokens/s counts the global batch's tokens (rows x seq); CPU s/step is each rank's process time per step (less
moved than wall time by other jobs on the cores; the collectives' waits on shared memory count in it); peak RSS
is each process's VmHWM; "activations (est.)" is bunsan.estimate's activations + masks for one rank.

    python benchmarks/bench_context_parallel.py                          # seq 2048 and 4096, 1 row, 3 steps
    python benchmarks/bench_context_parallel.py --seqs 256 --steps 1 --warmup 1
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist

import bunsan
from bunsan.memory.measure import peak_rss_bytes  # VmHWM: ru_maxrss carries the parent's peak across exec
from bench_dp import GiB, leave_result, machine, make_batches, spawn_ranks, timed_steps

WORLD = {"single": 1, "cp2": 2}


def _config(contender: str, a: dict, seq: int) -> dict:
    return {"train_micro_batch_size_per_gpu": a["rows"], "context_parallel": {"size": WORLD[contender]},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "data": {"seq_len": seq},
            "train": {"timeout_s": a["timeout"]}}


def _worker(rank: int, contender: str, seq: int, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)  # one core per rank: 2 ranks on 2 cores, comparable to the 1-thread ceiling
    world = WORLD[contender]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a["timeout"]))
    cfg = bunsan.models.build_config("tiny", max_position_embeddings=max(512, seq))
    torch.manual_seed(0)
    engine = bunsan.initialize(bunsan.models.Llama(cfg), _config(contender, a, seq))
    batches = make_batches(a["warmup"] + a["steps"], 0, a["rows"], seq, cfg.vocab_size)   # CP peers: same rows

    def step(x, y) -> float:
        return engine.train_batch({"input_ids": x, "labels": y})

    for x, y in batches[:a["warmup"]]:
        step(x, y)
    cpu0 = time.process_time()
    loss, elapsed = timed_steps(step, batches[a["warmup"]:], 0, world, average_loss=False)
    cpu = (time.process_time() - cpu0) / a["steps"]
    est = bunsan.estimate(cfg, _config(contender, a, seq), gpus=world, device_type="cpu")
    act = sum(i.device for i in est.items if i.name in ("activations", "context-parallel mask"))
    res = {"rank": rank, "tokens_per_s": a["rows"] * seq * a["steps"] / elapsed, "loss": loss, "cpu_s": cpu,
           "peak_rss": peak_rss_bytes(), "activations": act}
    leave_result(outdir, contender, rank, res, world)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="2048,4096", help="comma list of sequence lengths (multiples of 4)")
    p.add_argument("--rows", type=int, default=1, help="rows per step")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the clock starts")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per contender before its ranks are killed")
    args = p.parse_args(argv)
    header = ["seq", "contender", "ranks", "tokens/s", "vs single", "vs ceiling", "CPU s/step/rank (max)",
              "peak RSS/rank GiB", "activations/rank GiB (est.)", "loss"]
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        single = None
        for c in WORLD:
            rs = spawn_ranks(_worker, c, WORLD[c], args, extra=(seq,))
            tps = rs[0]["tokens_per_s"]     # global tokens: every rank times the same steps
            single = single or tps
            rows.append([str(seq), c, str(WORLD[c]), f"{tps:,.0f}", f"{tps / single:.2f}",
                         f"{tps / (2 * single):.2f}", f"{max(r['cpu_s'] for r in rs):.3f}",
                         f"{max(r['peak_rss'] for r in rs) / GiB:.3f}",
                         f"{rs[0]['activations'] / GiB:.3f}", f"{rs[0]['loss']:.4f}"])
            print(" | ".join(rows[-1]), flush=True)
    print(f"\nmachine: {machine()}\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
