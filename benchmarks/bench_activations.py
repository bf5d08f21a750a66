"""Activation memory and speed of bunsan's Llama block before and after issue #24, on CPU, one process.

"before" runs the eager forms the block used to have (RMSNorm upcast in Python, silu(gate) * up through
autograd), swapped in on the same model; "after" is the model as it is (models/saving.py). Per recompute mode
(none, full, selective), block and dtype: the bytes a forward leaves for backward (memory/held.py: saved
tensors and selective recompute's kept outputs), the peak of live tensors during one forward + backward (a
dispatch mode: CPU has no allocator statistics), the estimator's count for the same micro-batch, and tokens/s
over a few steps.

    python benchmarks/bench_activations.py [--layers 4] [--seq 1024] [--micro 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from bench_dp import machine  # noqa: E402
from live_bytes import LiveBytes  # noqa: E402

from bunsan.estimator.activations import Micro  # noqa: E402
from bunsan.estimator.recompute import stage_bytes  # noqa: E402
from bunsan.memory.held import held_for_backward  # noqa: E402
from bunsan.models.llama import MLP, Llama, LlamaConfig, RMSNorm  # noqa: E402
from bunsan.models.loss import lm_loss_sum  # noqa: E402
from bunsan.transforms.checkpointing import apply_activation_checkpointing  # noqa: E402
from bunsan.transforms.selective import apply_selective_recompute  # noqa: E402

MiB = 1024 ** 2


def eager_norm(self, x):
    xf = x.float()
    return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def eager_mlp(self, x):
    return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build(args, dtype, before: bool, recompute: str) -> Llama:
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = Llama(cfg).to(dtype)
    if before:
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.forward = eager_norm.__get__(m)
            elif isinstance(m, MLP):
                m.forward = eager_mlp.__get__(m)
    if recompute == "full":
        apply_activation_checkpointing(model)
    elif recompute == "selective":
        apply_selective_recompute(model)
    return model


def step(model, ids):
    loss = lm_loss_sum(model(ids), ids) / ids.numel()
    loss.backward()
    model.zero_grad(set_to_none=True)


def held_bytes(model, ids) -> int:
    """What the forward (loss included) leaves alive for backward, on the CPU."""
    loss, held = held_for_backward(lambda: lm_loss_sum(model(ids), ids))
    del loss
    return held.get("cpu", 0)


def measure(args, dtype, before: bool, recompute: str) -> dict:
    model = build(args, dtype, before, recompute)
    ids = torch.randint(0, model.config.vocab_size, (args.micro, args.seq))
    saved = held_bytes(model, ids)
    live = LiveBytes()
    with live:
        step(model, ids)
    step(model, ids)    # warm-up
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(model, ids)
    tok_s = args.steps * ids.numel() / (time.perf_counter() - t0)
    m = Micro(args.micro, args.seq, dtype.itemsize, device="cpu")
    est = stage_bytes(model.config, m, args.layers, first=True, last=True, mode=recompute)
    return {"saved": saved, "peak": live.peak, "estimate": est["kept"], "tok_s": tok_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"## Activation memory of the Llama block, before and after issue #24\n\n- command: `python "
          f"benchmarks/bench_activations.py --layers {args.layers} --seq {args.seq} --micro {args.micro} --steps "
          f"{args.steps}`\n- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, commit "
          f"{commit}, machine: {machine()}\n- model: h 512, i 1408, 8 heads / 2 KV heads, vocab 8192, "
          f"{args.layers} layers; micro-batch {args.micro} x {args.seq} tokens, one process\n")
    print("| dtype | recompute | block | held for backward MiB | estimator kept MiB | peak live MiB | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for recompute in ("none", "selective", "full"):
            for before in (True, False):
                r = measure(args, dtype, before, recompute)
                est = f"{r['estimate'] / MiB:.1f}" if not before else "-"
                print(f"| {str(dtype).removeprefix('torch.')} | {recompute} | "
                      f"{'before (eager)' if before else 'after'} | {r['saved'] / MiB:.1f} | {est} | "
                      f"{r['peak'] / MiB:.1f} | {r['tok_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
