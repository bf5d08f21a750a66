"""Diagnostics for bench_deepspeed.py: rerun its cases with one difference between the sides removed, to show
that difference is the cause of a curve mismatch. Each --patch changes one side only:

  ds-no-init-step     DeepSpeed: undo FP16_UnfusedOptimizer's optimizer.step() on zero gradients at construction
                      (bf16 without ZeRO): after initialize, the fp32 masters are reset to the bf16 weights and
                      the optimizer state is dropped; prints the Adam step count and master drift it had made
  ds-plain-linear     DeepSpeed: zero_optimization.memory_efficient_linear false (ZeRO-3 then keeps torch's
                      F.linear instead of its matmul-then-add-bias LinearFunctionForZeroStage3)
  bunsan-norm-fp64    bunsan: gradient-norm squares summed in fp64 element by element, instead of fp32 norms per
                      tensor squared in fp64

    python benchmarks/bench_deepspeed_diag.py --patch ds-no-init-step --cases bf16-z0-noclip
"""
from __future__ import annotations

import os
import sys

import torch

import bench_deepspeed as bd

PATCHES = ("ds-no-init-step", "ds-plain-linear", "bunsan-norm-fp64")


def _undo_init_step(engine) -> None:
    opt = engine.optimizer
    if not hasattr(opt, "fp32_groups"):   # ZeRO or fp32: no FP16_UnfusedOptimizer, nothing to undo
        return
    steps = {float(s["step"]) for s in opt.optimizer.state.values() if "step" in s}
    drift = max((p32 - p16.float()).abs().max().item() for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups)
                for p16, p32 in zip(g16, g32))
    print(f"{type(opt).__name__}: Adam step count(s) after initialize {sorted(steps)}, "
          f"max |fp32 master - bf16 weight| {drift:.3g}; undone", flush=True)
    for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups):
        for p16, p32 in zip(g16, g32):
            p32.data.copy_(p16.data.float())
    opt.optimizer.state.clear()


def _patched_train(deepspeed, model, config, data):
    patch = os.environ.get("BENCH_DS_PATCH")
    if deepspeed.__name__ == "deepspeed" and patch == "ds-plain-linear":
        config["zero_optimization"]["memory_efficient_linear"] = False
    if deepspeed.__name__ == "deepspeed" and patch == "ds-no-init-step":
        real = deepspeed.initialize

        def initialize(**kwargs):
            out = real(**kwargs)
            _undo_init_step(out[0])
            return out
        deepspeed.initialize = initialize
    return _TRAIN(deepspeed, model, config, data)


def _squared_norm_fp64(self, flat, pieces):
    excluded = self.norm_excluded
    views = [flat] if not excluded else [v for i, v in pieces if i not in excluded and v.numel()]
    return sum((v.double().square().sum() for v in views), torch.zeros((), dtype=torch.float64)).reshape(1)


# Applied at import: the spawned ranks import this file as their __main__ too, so they get the patch.
_TRAIN = bd.train
bd.train = _patched_train
if os.environ.get("BENCH_DS_PATCH") == "bunsan-norm-fp64":
    from bunsan.zero.strategy import Strategy
    Strategy.squared_norm = _squared_norm_fp64


def main(argv: list[str]) -> int:
    if "--patch" not in argv or argv.index("--patch") + 1 >= len(argv):
        sys.exit(f"usage: bench_deepspeed_diag.py --patch {{{','.join(PATCHES)}}} [bench_deepspeed options]")
    i = argv.index("--patch")
    patch, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    if patch not in PATCHES:
        sys.exit(f"unknown --patch {patch}; choose from {', '.join(PATCHES)}")
    os.environ["BENCH_DS_PATCH"] = patch   # inherited by the spawned ranks, read when they import this file
    return bd.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
