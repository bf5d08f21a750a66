"""The host step ZeRO-Offload runs, as the planner prices it (hardware.CPU_ADAM_PARAMS_PER_S) and as
benchmarks/bench_cpu_adam.py measures it: in a GPU run bunsan's offloaded AdamW is torch's fused CPU kernel, and
the benchmark that checks the planner's figure runs (its figures go to RESULTS.md, not here)."""

import sys
from pathlib import Path

import torch

from bunsan.config.optimizer_sections import Optimizer
from bunsan.optim.optimizers import optimizer_spec
from bunsan.optim.stepping import rebuild

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_a_gpu_runs_offloaded_adamw_steps_with_torchs_fused_cpu_kernel():
    """The configured AdamW of a CUDA run carries fused=True (optim/optimizers.optimizer_spec), and the sharded
    optimizer rebuilds it over the host shard (optim/stepping.rebuild): torch's fused CPU AdamW, the benchmark's 'torch
    fused' row, is what the planner's figure prices."""
    weight = torch.nn.Parameter(torch.zeros(64))
    cls, defaults, groups = optimizer_spec(None, Optimizer(type="AdamW", params={"lr": 1e-3}), [weight],
                                           torch.device("cuda"))
    assert cls is torch.optim.AdamW and defaults["fused"] is True
    shard = torch.nn.Parameter(torch.zeros(64))          # the host shard: a CPU tensor
    shard.grad = torch.ones(64)
    opt = rebuild(cls, [{"params": [shard], **groups[0][1]}], defaults)     # as zero/optimizer.py builds it
    assert opt.param_groups[0]["fused"] is True
    opt.step()
    assert torch.allclose(shard.detach(), torch.full((64,), -1e-3))     # Adam's first step: -lr x sign(grad)


def test_the_benchmark_prints_every_torch_implementation_against_the_planners_figure(capsys, monkeypatch):
    import bench_cpu_adam
    monkeypatch.setattr(bench_cpu_adam, "deepspeed_adam", lambda: None)     # (its op compiles on first use)
    assert bench_cpu_adam.main(["--params", "4096", "--steps", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "x the planner's figure" in out and "params/s per process (hardware.CPU_ADAM_PARAMS_PER_S)" in out
    for name in ("torch fused", "torch foreach", "torch default"):
        assert f"| {name} | 1 |" in out
