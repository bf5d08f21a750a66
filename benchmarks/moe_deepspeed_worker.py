"""bench_moe.py's deepspeed-ep2 contender, run by DeepSpeed's own venv's Python (argv[1]: bench_moe's arguments
as JSON): 2 spawned ranks, deepspeed.moe.layer.MoE(k=2, drop_tokens=False, ep_size=2) of a SwiGLU expert the
shape of bunsan's, deepspeed.initialize, SGD; prints {"ranks": [{tokens_per_s, peak_rss, params}, ...]}."""
from __future__ import annotations

import datetime
import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(rank: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(a["port"]))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=a["timeout"]))
    torch.manual_seed(0)
    layer = deepspeed.moe.layer.MoE(hidden_size=a["hidden"], expert=SwiGLU(a["hidden"], a["width"]),
                                    num_experts=a["experts"], ep_size=2, k=2, drop_tokens=False, min_capacity=0)
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(layer.parameters()), "name": "parameters"})
    engine, _, _, _ = deepspeed.initialize(model=layer, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "steps_per_print": 10 ** 9})

    def step(s):
        g = torch.Generator().manual_seed(1000 * s + rank)
        out, _, _ = engine(torch.randn(a["tokens"], a["hidden"], generator=g))
        engine.backward(out.float().square().sum())
        engine.step()
    for s in range(a["warmup"]):
        step(s)
    start = time.perf_counter()
    for s in range(a["steps"]):
        step(a["warmup"] + s)
    elapsed = time.perf_counter() - start
    result = {"tokens_per_s": a["tokens"] * a["steps"] / elapsed, "peak_rss": peak_rss(),
              "params": sum(p.numel() for p in layer.parameters())}
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(args, out), nprocs=2, start_method="spawn")
        print(json.dumps({"ranks": [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(2)]}))
