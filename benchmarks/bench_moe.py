"""Mixture-of-experts step: bunsan's MoE block beside transformers' Mixtral block and DeepSpeed's MoE layer, and
expert parallelism against data parallelism, tokens/s and peak memory per rank, all-to-all bytes against theory.

One block (hidden --hidden, --experts SwiGLU experts of width --width, top-2, dropless, fp32), forward and
backward of --tokens tokens per rank per step, the loss the sum of squares of the output (the same work for
every contender). Each contender runs in fresh spawned processes, one thread per rank, one after another:

  bunsan-grouped_mm   bunsan's block, experts by torch._grouped_mm (1 process)
  bunsan-loop         bunsan's block, one matmul per expert (1 process)
  transformers        transformers' MixtralSparseMoeBlock, its eager experts loop (1 process)
  transformers-grouped_mm   the same block with experts_implementation "grouped_mm" (1 process)
  bunsan-dp2          2 ranks, every expert on both, gradients all-reduced (bunsan.initialize, ZeRO 0)
  bunsan-ep2          2 ranks, half the experts each, tokens by all-to-all (expert_parallel.autoep_size 2)
  deepspeed-ep2       2 ranks, deepspeed.moe.layer.MoE(k=2, drop_tokens=False, ep_size=2) with a SwiGLU
                      expert, run in the venv of --deepspeed-python (DeepSpeed 0.19.8 and torch 2.13 CPU;
                      benchmarks/README.md says how to make it); skipped, said, without it

The theory for EP's all-to-all: per block forward each rank sends the rows routed to the other rank's experts
(each hidden x 4 bytes), there and back, and backward the same again: 4 x that; with the assignments spread
evenly over the experts that is 4 x top_k x tokens x (ep - 1) / ep rows. Measured from bunsan's comm stats (the
bytes a rank really sent); below the even figure when a rank's tokens favour its own experts.

    python benchmarks/bench_moe.py                       # hidden 512, 8 experts of 1024, 2048 tokens per rank
    python benchmarks/bench_moe.py --tokens 256 --steps 2 --warmup 1 --markdown benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

from bench_dp import free_port, markdown_section, print_section, spawn_ranks
from bunsan.memory.measure import peak_rss_bytes

MiB = 2 ** 20
SINGLE = ("bunsan-grouped_mm", "bunsan-loop", "transformers", "transformers-grouped_mm")
WORLD = {"bunsan-grouped_mm": 1, "bunsan-loop": 1, "transformers": 1, "transformers-grouped_mm": 1, "bunsan-dp2": 2,
         "bunsan-ep2": 2, "deepspeed-ep2": 2}


def moe_config(a: dict, kernel: str = "auto"):
    from bunsan.models.moe_config import MoEConfig
    return MoEConfig(hidden_size=a["hidden"], num_experts=a["experts"], top_k=2, expert_intermediate_size=a["width"],
                     route_norm=True, expert_kernel=kernel)


def tokens_for(step: int, rank: int, a: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(a["tokens"], a["hidden"], generator=g)


def build(contender: str, a: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if contender.startswith("bunsan"):
        from bunsan.models.moe import MoE
        return MoE(moe_config(a, "loop" if contender == "bunsan-loop" else "auto"))
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = transformers.MixtralConfig(hidden_size=a["hidden"], intermediate_size=a["width"],
                                     num_local_experts=a["experts"], num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm" if contender.endswith("grouped_mm") else "eager"
    return MixtralSparseMoeBlock(cfg)


def _timed(step_fn, a: dict, rank: int) -> dict:
    for s in range(a["warmup"]):
        step_fn(tokens_for(s, rank, a))
    start = time.perf_counter()
    for s in range(a["steps"]):
        step_fn(tokens_for(a["warmup"] + s, rank, a))
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": a["tokens"] * a["steps"] / elapsed, "peak_rss": peak_rss_bytes()}


def _worker(rank: int, contender: str, world: int, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=a["timeout"]))
        out = _run(rank, contender, a)
    except Exception:   # noqa: BLE001  (said in the table, the benchmark goes on)
        out = {"error": traceback.format_exc(limit=3).strip().splitlines()[-1]}
    with open(os.path.join(outdir, f"{contender}-{rank}.json"), "w") as f:
        json.dump(out, f)


def _run(rank: int, contender: str, a: dict) -> dict:
    module = build(contender, a)
    if contender in SINGLE:
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)

        def step(x):
            out = module(x.unsqueeze(0)) if contender.startswith("transformers") else module(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        result = _timed(step, a, rank)
        result["params"] = sum(p.numel() for p in module.parameters())
        return result
    import bunsan
    ep = 2 if contender == "bunsan-ep2" else 1
    engine = bunsan.initialize(module, {"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "SGD", "params": {"lr": 1e-3}}, "expert_parallel": {"enabled": ep > 1, "autoep_size": ep}},
        loss_fn=lambda out, _: out.float().square().sum())

    def step(x):
        engine.train_batch((x.unsqueeze(0), torch.zeros(1)))
    result = _timed(step, a, rank)
    stats = engine.comm_stats()["step"]
    result["a2a_bytes"] = stats.get("all_to_all_v/ep", {}).get("bytes", 0)
    result["params"] = sum(p.numel() for p in engine.module.parameters())
    result["model_states"] = engine.memory_report()["model_states"]
    return result


def run_deepspeed(a: argparse.Namespace) -> list[dict]:
    """The deepspeed-ep2 contender in DeepSpeed's own venv (a subprocess: bunsan's pinned set stays as it is)."""
    if not a.deepspeed_python or not os.path.exists(a.deepspeed_python):
        return [{"error": "no --deepspeed-python (a venv with deepspeed==0.19.8; benchmarks/README.md)"}]
    script = os.path.join(os.path.dirname(__file__), "moe_deepspeed_worker.py")
    cmd = [a.deepspeed_python, script, json.dumps({**vars(a), "port": free_port()})]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return [{"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}]
    return json.loads(lines[-1])["ranks"]


def theory_a2a(a: argparse.Namespace) -> float:
    """Expected bytes one rank sends per step under EP 2 (see the module docstring): routed rows off-rank."""
    return 4 * 2 * a.tokens * 0.5 * a.hidden * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--contenders", default=",".join(WORLD))
    p.add_argument("--deepspeed-python", default="/tmp/dsvenv/bin/python")
    p.add_argument("--markdown")
    a = p.parse_args()
    results = {}
    for c in a.contenders.split(","):
        if c == "deepspeed-ep2":
            results[c] = run_deepspeed(a)
        else:
            try:
                results[c] = spawn_ranks(_worker, c, WORLD[c], a, extra=(WORLD[c],))
            except Exception as e:   # noqa: BLE001
                results[c] = [{"error": f"{type(e).__name__}: {e}"}]
        print(c, results[c], flush=True)
    header = ["contender", "ranks", "tokens/s (sum)", "peak RSS/rank MiB (max)", "params/rank",
              "all-to-all bytes/step/rank (measured / uniform routing)"]
    rows = []
    for c, rs in results.items():
        if any("error" in r for r in rs):
            rows.append([c, str(WORLD[c]), next(r["error"] for r in rs if "error" in r), "", "", ""])
            continue
        a2a = max(r.get("a2a_bytes", 0) for r in rs)
        said = f"{a2a / MiB:.2f} MiB / {theory_a2a(a) / MiB:.2f} MiB" if c.endswith("ep2") and a2a else ""
        rows.append([c, str(len(rs)), f"{sum(r['tokens_per_s'] for r in rs):,.0f}",
                     f"{max(r['peak_rss'] for r in rs) / MiB:,.0f}", f"{max(r['params'] for r in rs):,}", said])
    notes = [f"block: hidden {a.hidden}, {a.experts} SwiGLU experts of width {a.width}, top-2, dropless, fp32; "
             f"{a.tokens} tokens per rank per step, {a.steps} timed steps after {a.warmup}; one thread per rank"]
    print_section(markdown_section("Mixture of experts: one block's step, EP vs DP (issue #64)", notes, header,
                                   rows), a.markdown)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
