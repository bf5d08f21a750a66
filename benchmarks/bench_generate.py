"""Greedy generation throughput: one process, tensor parallel over 2 ranks, and a device map over CPU and disk,
next to transformers' own generate on the same Hugging Face Llama.

    python benchmarks/bench_generate.py [--new-tokens 64] [--batch 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512)


def _ids(batch):
    import torch
    return torch.randint(0, SHAPE["vocab_size"], (batch, 32), generator=torch.Generator().manual_seed(0))


def one(rank, world, path, batch, new, mode):
    import torch
    torch.set_num_threads(1)
    from bunsan.models import generate
    ids = _ids(batch)
    if mode == "transformers":
        import transformers
        model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
        run = lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)  # noqa: E731
    elif mode.startswith("device_map"):
        from bunsan.inference import load, model_blocks
        from bunsan.models.hf import load_llama
        budget = None
        if mode == "device_map_disk":   # a CPU budget of half the weights; the rest on disk, read for every token
            budget = {"cpu": sum(b.bytes for b in model_blocks(load_llama(path), torch.float32)) // 2}
        model, _ = load(path, "sequential", budget, batch=ids.shape[0], max_seq=ids.shape[1] + new,
                        prompt_len=ids.shape[1])
        run = lambda: generate(model, ids, new)  # noqa: E731
    else:
        from bunsan.models.hf import load_llama
        model = load_llama(path).eval()
        kv = None
        if mode == "tp":
            from bunsan.comm.collectives import Comm
            from bunsan.comm.mesh import Mesh
            from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
            mesh = Mesh.create(tp=world)
            apply_tensor_parallel(model, TPContext(Comm(), mesh.tp_group)).gather_output = True
            kv = model.config.num_key_value_heads // world
        run = lambda: generate(model, ids, new, kv_heads=kv)  # noqa: E731
    with torch.no_grad():
        run()                                    # warm-up
        t0 = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - t0
    return batch * new / seconds, out[:, -new:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    import torch
    import transformers
    from dist_harness import Pools
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="bench-gen-")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)
    print(f"# bench_generate {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, {os.cpu_count()} CPUs, "
          f"batch {args.batch}, {args.new_tokens} new tokens, greedy, fp32, 1 thread per process", flush=True)
    pools = Pools()
    rows = ["| contender | processes | tokens/s | same tokens as one process |", "|---|---|---|---|"]
    try:
        base = None
        for mode, world in (("single", 1), ("transformers", 1), ("tp", 2), ("device_map_cpu", 1),
                            ("device_map_disk", 1)):
            res = pools.run(world, one, world, path, args.batch, args.new_tokens, mode, timeout=900)
            tps, toks = res[0]
            base = toks if base is None else base
            rows.append(f"| {mode} | {world} | {tps:,.1f} | {'yes' if toks == base else 'no'} |")
            print(rows[-1], flush=True)
    finally:
        pools.close()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
