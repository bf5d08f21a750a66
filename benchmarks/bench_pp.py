"""Pipeline parallelism on CPU: bunsan PP=2 (GPipe, 1F1B, interleaved) vs torch.distributed.pipelining.

For each m in --m (default p, 2p, 4p, 8p = 2, 4, 8, 16 micro-batches of --micro-batch rows x seq tokens per
step), every contender trains the same Llama-like model (bench_tp's shape) from the same weights (drawn by
parameter name with bunsan's default train.seed 1234, as a meta-built bunsan model materialises them) on the
same batches, fp32 AdamW lr 1e-4, in fresh spawned processes with one thread per rank, one run at a time:

  single              1 process, the whole model, the step's m micro-batches with gradient accumulation: T1
  bunsan-gpipe        bunsan.initialize(meta model, pipeline {stages 2, schedule gpipe}), m micro-batches
  bunsan-1f1b         ... schedule 1f1b
  bunsan-interleaved  ... schedule interleaved, virtual_stages --virtual-stages (2)
  torch-gpipe         torch.distributed.pipelining PipelineStage + ScheduleGPipe on the same split (bunsan's
                      --partition, default balanced by matmul parameters: the head outweighs a block),
                      each rank allocating only its half; loss = per-micro-batch mean cross-entropy, gradients
                      scaled by 1/m by the schedule (scale_grads): the same gradients as bunsan's token mean
  torch-1f1b          ... Schedule1F1B

Bubble-limited ideal of 2 ranks at m: 2 x T1 x (1 - theory_bubble(schedule, 2, m, v)). Measured bubble (bunsan):
the mean over timed steps of timeline.summarise(engine.pipeline_timeline()).bubble; derived bubble (every PP
row): 1 - tokens/s / (2 x T1). Targets: at every m, bunsan's best schedule at or above torch's best, and each
bunsan row's |measured - theory| / theory <= 10%.

    python benchmarks/bench_pp.py --markdown benchmarks/RESULTS.md    # ~34M params, seq 256, m = 2, 4, 8, 16
    python benchmarks/bench_pp.py --hidden 64 --layers 4 --vocab 256 --seq 32 --steps 1 --warmup 1 --m 2,4
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import bunsan
from bunsan.memory.measure import peak_rss_bytes  # VmHWM: ru_maxrss carries the parent's peak across exec
from bench_dp import (GiB, contender_list, leave_result, machine, make_batches, run_one_by_one,  # shared with bench_dp
                      spawn_ranks)
from bench_tp import model_config
from bench_zero import LR, failure_reason, lm_loss
from bunsan.models.llama import rope_tables
from bunsan.pipeline.partition import model_layers, partition
from bunsan.pipeline.schedules import theory_bubble
from bunsan.pipeline import simulated_bubble
from bunsan.pipeline.timeline import summarise

P = 2          # pipeline ranks
SEED = 1234    # bunsan's default train.seed: what meta materialisation draws each weight by name with
CONTENDERS = ("single", "bunsan-gpipe", "bunsan-1f1b", "bunsan-interleaved", "torch-gpipe", "torch-1f1b")


def schedule_of(c: str, a: dict) -> tuple[str, int]:
    """(schedule name, virtual stages) of a pipelined contender."""
    name = c.split("-", 1)[1]
    return name, a["virtual_stages"] if name == "interleaved" else 1


class Half(nn.Module):
    """One torch pipeline stage: the bunsan Llama's modules at `paths` (in order), one tensor in, one out."""

    def __init__(self, model: nn.Module, paths: list[str], seq: int):
        super().__init__()
        self.paths = paths
        self.mods = nn.ModuleList(model.get_submodule(p) for p in paths)
        self.to_empty(device="cpu")  # allocate only this half; weights drawn by their names in the whole model
        with torch.no_grad():
            for name, prm in self.named_parameters():
                j, rest = name.split(".", 2)[1:]
                model.init_parameter(f"{paths[int(j)]}.{rest}", prm, SEED)
        cos, sin = rope_tables(model.config)
        self.register_buffer("cos", cos[:seq].contiguous(), persistent=False)
        self.register_buffer("sin", sin[:seq].contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for path, mod in zip(self.paths, self.mods):
            x = mod(x, self.cos, self.sin) if path.startswith("layers.") else mod(x)
        return x


def make_step(c: str, m: int, rank: int, a: dict):
    """(x, y) of the whole step's batch [m*mb, seq] -> global mean loss after one optimizer step; plus a
    function called after each timed step returning its measured bubble (or None)."""
    cfg = model_config(a)
    with torch.device("meta"):
        model = bunsan.models.Llama(cfg)
    if c == "single":
        model.to_empty(device="cpu")
        model.init_weights(seed=SEED)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def single(x, y) -> float:
            total = 0.0
            for xs, ys in zip(x.chunk(m), y.chunk(m)):  # equal token counts: mean of the means = step's mean
                loss = lm_loss(model(xs), ys) / m
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total
        return single, lambda: None

    schedule, v = schedule_of(c, a)
    if c.startswith("bunsan"):
        engine = bunsan.initialize(model, {
            "train_micro_batch_size_per_gpu": a["micro_batch"], "gradient_accumulation_steps": m,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "pipeline": {"stages": P, "schedule": schedule, "virtual_stages": v, "partition": a["partition"]}})
        def bubbles() -> tuple[float, float]:   # collective: every rank calls it
            per_rank = engine.pipeline_timeline()
            return summarise(per_rank).bubble, simulated_bubble(per_rank, engine.pipe)
        return (lambda x, y: engine.train_batch({"input_ids": x, "labels": y})), bubbles

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    layers = model_layers(model)
    chunk = partition(layers, P, a["partition"])[rank]  # bunsan's split
    half = Half(model, [p for i in chunk for p in layers[i].paths], a["seq"])
    stage = PipelineStage(half, rank, P, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = cls(stage, n_microbatches=m, loss_fn=lm_loss)  # scale_grads=True: gradients / m
    opt = torch.optim.AdamW(half.parameters(), lr=LR)

    def torch_step(x, y) -> float:
        losses: list = []
        if rank == 0:
            pipe.step(x, return_outputs=False)
        else:
            pipe.step(target=y, losses=losses, return_outputs=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.stack(losses).detach().mean().reshape(1) if rank == P - 1 else torch.zeros(1)
        dist.broadcast(t, src=P - 1)  # as bunsan's train_batch: the loss on every rank, one sync per step
        return t.item()
    return torch_step, lambda: None


def _worker(rank: int, key: str, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)  # one core per rank: 2 ranks on 2 cores, comparable to the 1-thread T1
    c, m = key.split("@m")[0], int(key.split("@m")[1])
    world = 1 if c == "single" else P
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a["timeout"]))
    batches = make_batches(a["warmup"] + a["steps"], 0, m * a["micro_batch"], a["seq"], a["vocab"])
    step, bubble = make_step(c, m, rank, a)
    losses, times, bubbles = [], [], []
    for i, (x, y) in enumerate(batches):
        if world > 1:
            dist.barrier()  # every step starts together; the timeline gather below stays off the clock
        t0 = time.perf_counter()
        losses.append(step(x, y))
        dt = time.perf_counter() - t0
        b = bubble()
        if i >= a["warmup"]:
            times.append(dt)
            bubbles.append(b)
    if world > 1:  # a step lasts as long as its slowest rank
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    bubbles = [b for b in bubbles if b is not None]
    res = {"rank": rank, "elapsed": sum(times), "losses": losses,
           "bubble": sum(b[0] for b in bubbles) / len(bubbles) if bubbles else None,
           "bubble_sim": sum(b[1] for b in bubbles) / len(bubbles) if bubbles else None,
           "peak_rss": peak_rss_bytes()}
    leave_result(outdir, key, rank, res, world)


def run_contender(key: str, args: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_worker, key, 1 if key.startswith("single") else P, args)


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def build_rows(results: dict, a: argparse.Namespace):
    header = ["contender", "m", "tokens/s", "vs ideal", "vs torch", "bubble measured", "bubble derived",
              "bubble theory", "bubble simulated (stage times)", "first / final loss", "peak RSS/rank GiB", "notes"]
    tps, meas, theory, sim = {}, {}, {}, {}
    for key, rs in results.items():
        c, m = key.split("@m")[0], int(key.split("@m")[1])
        if isinstance(rs, list):
            tps[c, m] = m * a.micro_batch * a.seq * a.steps / max(r["elapsed"] for r in rs)
            meas[c, m], sim[c, m] = rs[0]["bubble"], rs[0]["bubble_sim"]
        if c != "single":
            name, v = schedule_of(c, vars(a))
            theory[c, m] = theory_bubble(name, P, m, v)
    rows = []
    for key, rs in results.items():
        c, m = key.split("@m")[0], int(key.split("@m")[1])
        th = theory.get((c, m))
        if not isinstance(rs, list):
            rows.append([c, str(m), "FAILED"] + ["-"] * (len(header) - 4) + [rs])
            continue
        t1 = tps.get(("single", m))
        ideal = 2 * t1 * (1 - th) if t1 and th is not None else None
        peer = tps.get(("torch-" + c.split("-", 1)[1], m)) if c.startswith("bunsan") else None
        derived = 1 - tps[c, m] / (2 * t1) if t1 and c != "single" else None
        rows.append([c, str(m), f"{tps[c, m]:,.0f}", f"{tps[c, m] / ideal:.2f}" if ideal else "-",
                     f"{tps[c, m] / peer:.2f}" if peer else "-", fmt_pct(meas[c, m]), fmt_pct(derived),
                     fmt_pct(th), fmt_pct(sim[c, m]), f"{rs[0]['losses'][0]:.4f} / {rs[0]['losses'][-1]:.4f}",
                     " / ".join(f"{r['peak_rss'] / GiB:.3f}" for r in rs),
                     "rounds " + " / ".join(f"{m * a.micro_batch * a.seq * a.steps / e:.0f}"
                                            for e in rs[0]["round_elapsed"]) if "round_elapsed" in rs[0] else "-"])
    return header, rows, targets(tps, meas, theory, sim, sorted({m for _, m in tps}))


def targets(tps: dict, meas: dict, theory: dict, sim: dict, ms: list[int]):
    header = ["m", "bunsan best", "torch best", "best vs best (>= 1.00)", "gpipe vs torch", "1f1b vs torch",
              "bubble error |meas - theory| / theory (<= 10%)", "meas - theory (points)",
              "meas - simulated (points)", "throughput", "bubble"]
    rows = []
    for m in ms:
        b = {c.split("-", 1)[1]: t for (c, mm), t in tps.items() if mm == m and c.startswith("bunsan")}
        t = {c.split("-", 1)[1]: v for (c, mm), v in tps.items() if mm == m and c.startswith("torch")}
        if not b:
            continue
        bb, tb = max(b, key=b.get), (max(t, key=t.get) if t else None)
        ratio = b[bb] / t[tb] if tb else None
        errs = {s: abs(meas[f"bunsan-{s}", m] - theory[f"bunsan-{s}", m]) / theory[f"bunsan-{s}", m]
                for s in b if meas.get((f"bunsan-{s}", m)) is not None}
        rows.append([str(m), f"{bb} {b[bb]:,.0f}", f"{tb} {t[tb]:,.0f}" if tb else "-",
                     f"{ratio:.2f}" if ratio else "-",
                     *(f"{b[s] / t[s]:.2f}" if s in b and s in t else "-" for s in ("gpipe", "1f1b")),
                     ", ".join(f"{s} {100 * e:.1f}%" for s, e in errs.items()) or "-",
                     ", ".join(f"{s} {100 * (meas[f'bunsan-{s}', m] - theory[f'bunsan-{s}', m]):+.1f}" for s in errs),
                     ", ".join(f"{s} {100 * (meas[f'bunsan-{s}', m] - sim[f'bunsan-{s}', m]):+.1f}" for s in errs),
                     "-" if ratio is None else "MET" if ratio >= 1.0 else "NOT MET",
                     "-" if not errs else "MET" if all(e <= 0.10 for e in errs.values()) else "NOT MET"])
    return header, rows


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |" for r in [header, ["---"] * len(header)]
            + rows]


def write_markdown(path: str, header, rows, target, n_params: int, a: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## Pipeline parallelism: bunsan PP=2 vs torch.distributed.pipelining (hidden {a.hidden}, "
             f"{a.layers} layers, vocab {a.vocab}, {n_params:,} params, m x {a.micro_batch} x {a.seq} tokens/step)",
             "", f"- date: {now}", f"- machine: {machine()}", f"- command: `python {shlex.join(sys.argv)}`",
             f"- {a.steps} timed step(s) after {a.warmup} warm-up step(s), {a.rounds} round(s) (medians); "
             "tokens/s = m x micro-batch x seq x steps "
             "/ the sum over steps of the slowest rank's step time (pipeline total); ideal = 2 x T1 x (1 - theory "
             "bubble), T1 = single-process 1-thread tokens/s at the same m; bubble measured = bunsan timeline "
             "(mean over timed steps), derived = 1 - tokens/s / (2 x T1); theory = (p-1)/(m+p-1), interleaved "
             f"((p-1)/v)/(m+(p-1)/v) with v = {a.virtual_stages}; vs torch = the same schedule's torch peer; "
             f"stages cut by bunsan's '{a.partition}' partition for every contender", ""]
    lines += md_table(header, rows) + ["", "Targets: bunsan's best schedule >= torch's best at every m; "
                                       "bubble within 10% of theory per bunsan row", ""]
    lines += md_table(*target)
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512, help="hidden size (8 heads; intermediate 43/16 x)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch")
    p.add_argument("--m", default="2,4,8,16", help="comma list of micro-batch counts per step")
    p.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank of bunsan-interleaved")
    p.add_argument("--partition", default="balanced", choices=("uniform", "parameters", "balanced"),
                   help="how bunsan cuts the model (the torch peers get the same cut; default balanced: the "
                        "head weighs more than a block, and theory assumes equal stages)")
    p.add_argument("--steps", type=int, default=4, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the clock starts")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every (contender, m) this many times, interleaved; tokens/s and bubbles are medians")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run before its ranks are killed")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the tables to PATH")
    args = p.parse_args(argv)
    contenders = contender_list(p, args.contenders, CONTENDERS)
    try:
        ms = [int(x) for x in args.m.split(",") if x.strip()]
    except ValueError:
        p.error(f"--m takes a comma list of integers, got {args.m!r}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or not ms or min(ms) < 1 or args.micro_batch < 1:
        p.error("--steps and --rounds must be >= 1, --warmup >= 0, --micro-batch >= 1 and every --m >= 1")
    try:
        n_params = model_config(vars(args)).num_params()  # fail fast on a bad shape, before spawning anything
    except ValueError as e:
        p.error(str(e))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(200, Console().width))  # the table is wide; never truncate its cells
    console.print(f"[bold]bench_pp[/]: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
                  f"{n_params:,} params, m in {ms} x {args.micro_batch} x {args.seq} tokens/step, "
                  f"{args.warmup}+{args.steps} steps; {machine()}")
    keys = [f"{c}@m{m}" for m in ms for c in contenders]
    results = run_one_by_one(keys, run_contender, args, console, on_failure=failure_reason, rounds=args.rounds)

    header, rows, target = build_rows(results, args)
    for title, (h, rs) in ((f"pipeline parallelism PP={P}, CPU/gloo, {n_params:,} params", (header, rows)),
                           ("targets", target)):
        table = Table(title=title)
        for col in h:
            table.add_column(col, justify="left" if col in ("contender", "notes") else "right", overflow="fold")
        for r in rs:
            table.add_row(*r)
        console.print(table)
    if args.markdown:
        write_markdown(args.markdown, header, rows, target, n_params, args)
        console.print(f"appended to {args.markdown}")
    return 1 if any(isinstance(rs, str) for rs in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
