"""The optimizer step ZeRO-Offload runs on the host, measured on this CPU: parameters per second of AdamW over one
flat fp32 shard, torch's three implementations beside DeepSpeed's CPUAdam, at each thread count. The planner prices
an offloaded step at hardware.CPU_ADAM_PARAMS_PER_S per process; this is where that figure can be checked.

    python benchmarks/bench_cpu_adam.py [--params 50e6] [--steps 5] [--markdown out.md]

Contenders:
  torch fused     torch.optim.AdamW(fused=True): what bunsan's offloaded step runs in a GPU run (optim/optimizers.py
                  passes fused=True on CUDA, and the sharded optimizer keeps it for the host shard)
  torch foreach   torch.optim.AdamW(foreach=True)
  torch default   torch.optim.AdamW(): the single-tensor loop, what a CPU run's step takes (no fused default there)
  deepspeed       deepspeed.ops.adam.DeepSpeedCPUAdam (ZeRO-Offload's SIMD kernel), where DeepSpeed is installed
                  and its op builds (DS_ACCELERATOR=cpu; the first use compiles it)

Each figure is the median of --steps timed steps after one warm-up step. Bytes per parameter and step: the fp32
weight, gradient and two moments read, the weight and moments written (28 B): the figure times 28 is the memory
bandwidth the step draws, which is what bounds it when a host's processes step at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from bench_dp import markdown_section, print_section

BYTES_PER_PARAM = 7 * 4


def torch_adamw(**kw):
    return lambda params: torch.optim.AdamW(params, lr=1e-3, **kw)


def deepspeed_adam():
    """DeepSpeed's CPUAdam, or None where it is not installed or its op does not build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.zeros(8)
        DeepSpeedCPUAdam([probe], lr=1e-3).step()
    except Exception as e:      # noqa: BLE001  (not installed, or its C++ op fails to build: said, not fatal)
        print(f"deepspeed: left out ({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return None
    return lambda params: DeepSpeedCPUAdam(params, lr=1e-3)


def params_per_s(build, numel: int, steps: int) -> float:
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.randn(numel)
    opt = build([param])
    opt.step()                  # warm-up: the moments are allocated here
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return numel / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=50e6, help="elements of the fp32 shard (default 50e6)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per figure (default 5)")
    p.add_argument("--threads", help="thread counts, e.g. 1,2 (default 1 to the cores this process may use)")
    p.add_argument("--markdown", help="append the table to this file")
    args = p.parse_args(argv)
    if args.params < 1 or args.steps < 1:
        p.error(f"--params {args.params:g} and --steps {args.steps} must be at least 1")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else list(range(1, cores + 1))
    contenders = {"torch fused": torch_adamw(fused=True), "torch foreach": torch_adamw(foreach=True),
                  "torch default": torch_adamw()}
    if (ds := deepspeed_adam()) is not None:
        contenders["deepspeed CPUAdam"] = ds
    from bunsan.estimator.hardware import CPU_ADAM_PARAMS_PER_S
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        for name, build in contenders.items():
            rate = params_per_s(build, int(args.params), args.steps)
            rows.append([name, str(n), f"{rate / 1e9:.2f}", f"{rate * BYTES_PER_PARAM / 1e9:.1f}",
                         f"{rate / CPU_ADAM_PARAMS_PER_S:.2f}"])
            print(f"{name:18} {n:2} thread(s): {rate / 1e9:.2f}e9 params/s", flush=True)
    header = ["AdamW step", "threads", "1e9 params/s", "GB/s drawn (28 B/param)", "x the planner's figure"]
    text = markdown_section("ZeRO-Offload's host step: AdamW on a CPU shard", [
        f"a {args.params:.3g}-element fp32 shard, median of {args.steps} steps; the planner's figure: "
        f"{CPU_ADAM_PARAMS_PER_S:.3g} params/s per process (hardware.CPU_ADAM_PARAMS_PER_S)"], header, rows)
    print_section(text, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
