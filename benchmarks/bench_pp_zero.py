"""Pipeline stages x ZeRO on CPU: memory per rank and tokens/s of PP 2 x DP 2 with ZeRO 1, 2 and 3.

Every contender trains the same model from the same weights on the same batches on 4 ranks (gloo, one
thread per rank; the runner may have fewer cores than ranks, so tokens/s compares contenders of one run only):

  zero1     gradients whole through the schedule, optimizer states sharded over the 2 data-parallel ranks
  zero2     the same through the schedule; the whole gradients freed after the reduce-scatter
  zero3     the stage's weights sharded too, its blocks gathered per micro-batch (forward and backward)
  zero3s    zero3 with stage3_pipeline_gather "schedule": gathered once, whole through the schedule

Peak RSS is the process's high-water mark; "states" is engine.memory_report()'s measured model states
beside bunsan's formula; "DP bytes/step" is the data-parallel traffic bunsan's communicator counted.

    python benchmarks/bench_pp_zero.py                                 # 135m shape, seq 256, 4 micro-batches
    python benchmarks/bench_pp_zero.py --preset tiny --seq 64 --steps 2 --warmup 1
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import bunsan
from bunsan.memory.measure import peak_rss_bytes  # VmHWM: ru_maxrss carries the parent's peak across exec
from bench_dp import (GiB, contender_list, leave_result, make_batches, markdown_section, run_one_by_one, spawn_ranks,
                      timed_steps)
from bench_zero import failure_reason

WORLD, PP = 4, 2
CONTENDERS = {"zero1": (1, "micro_batch"), "zero2": (2, "micro_batch"), "zero3": (3, "micro_batch"),
              "zero3s": (3, "schedule")}


def _worker(rank: int, contender: str, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=a["timeout"]))
    stage, gather = CONTENDERS[contender]
    cfg = bunsan.models.get_preset(a["preset"])
    torch.manual_seed(0)
    model = bunsan.models.Llama(cfg)
    dp = WORLD // PP
    engine = bunsan.initialize(model, {
        "train_micro_batch_size_per_gpu": a["micro_batch"], "gradient_accumulation_steps": a["micro"],
        "pipeline": {"stages": PP, "schedule": "1f1b"},
        "zero_optimization": {"stage": stage, "stage3_pipeline_gather": gather},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    rows = a["micro_batch"] * a["micro"]
    # the same global batch on every contender: each data-parallel rank its rows (pipeline peers the same)
    batches = make_batches(a["warmup"] + a["steps"], engine.dp_rank, rows, a["seq"], cfg.vocab_size)
    loss, elapsed = timed_steps(lambda x, y: engine.train_batch({"input_ids": x, "labels": y}), batches,
                                a["warmup"], WORLD, average_loss=False)
    mem = engine.memory_report()
    res = {"rank": rank, "tokens_per_s": dp * rows * a["seq"] * a["steps"] / elapsed / WORLD,  # each rank's share
           "peak_rss": peak_rss_bytes(), "loss": loss,
           "states": mem["model_states"], "theory": mem["theory_model_states"],
           "dp_bytes": sum(v["bytes"] for k, v in engine.comm_stats()["step"].items() if k.endswith("/dp"))}
    leave_result(outdir, contender, rank, res, WORLD)


def run_contender(contender: str, args: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_worker, contender, WORLD, args)


def build_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    header = ["contender", "tokens/s (sum)", "peak RSS/rank GiB (max)", "states/rank GiB (meas / formula, max)",
              "DP bytes/step/rank MiB (max)", "loss"]
    rows = []
    for c, rs in results.items():
        if isinstance(rs, str):
            rows.append([c, "failed: " + rs] + [""] * (len(header) - 2))
            continue
        top = max(rs, key=lambda r: r["states"])
        rows.append([c, f"{sum(r['tokens_per_s'] for r in rs):,.0f}", f"{max(r['peak_rss'] for r in rs) / GiB:.3f}",
                     f"{top['states'] / GiB:.3f} / {top['theory'] / GiB:.3f}",
                     f"{max(r['dp_bytes'] for r in rs) / 2 ** 20:.1f}", f"{rs[0]['loss']:.4f}"])
    return header, rows


def write_markdown(path: str, header: list[str], rows: list[list[str]], args: argparse.Namespace) -> None:
    title = (f"Pipeline x ZeRO: PP {PP} x DP {WORLD // PP} ({args.preset}, seq {args.seq}, micro-batch "
             f"{args.micro_batch}, {args.micro} micro-batches)")
    with open(path, "a") as f:
        f.write(markdown_section(title, [], header, rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="135m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch per data-parallel rank")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step (the pipeline's)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    args = p.parse_args(argv)
    contenders = contender_list(p, args.contenders, CONTENDERS)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rich.console import Console
    console = Console(width=200)
    results = run_one_by_one(contenders, run_contender, args, console, on_failure=failure_reason)
    header, rows = build_rows(results)
    console.print(" | ".join(header))
    for r in rows:
        console.print(" | ".join(r))
    if args.markdown:
        write_markdown(args.markdown, header, rows, args)
    return 1 if any(isinstance(rs, str) for rs in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
