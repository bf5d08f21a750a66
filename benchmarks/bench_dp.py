"""Data parallelism on CPU: bunsan vs torch DDP vs the single-process ceiling.

Three contenders train the same model from the same weights on the same batches:

  single   1 process, 1 thread, plain PyTorch loop; 2 x its tokens/s is "the ceiling" for 2 ranks
  ddp      2 processes, gloo, torch.nn.parallel.DistributedDataParallel (default buckets)
  bunsan   2 processes, gloo, bunsan.initialize(model, config).train_batch(batch)

Each contender runs in fresh spawned processes, one contender after another, so peak RSS
(VmHWM) is comparable: nothing big is allocated in a worker before its model is built.

    python benchmarks/bench_dp.py                        # SmolLM-135M shape, seq 256, micro-batch 2
    python benchmarks/bench_dp.py --preset tiny --seq 64 --steps 3 --warmup 1 --markdown benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import bunsan
from bunsan.memory.measure import peak_rss_bytes  # VmHWM: ru_maxrss carries the parent's peak across exec

GiB = 2 ** 30
WORLD = {"single": 1, "ddp": 2, "bunsan": 2}
DATA_SEED = 1234


def make_batches(steps: int, rank: int, mb: int, seq: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens, a fixed generator per (step, rank): every contender sees the same batches.
    Labels are the inputs shifted by one, shape [mb, seq]."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(DATA_SEED + 1000 * step + rank)
        tok = torch.randint(vocab, (mb, seq + 1), generator=g)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def _worker(rank: int, contender: str, world: int, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)  # one core per rank: 2 ranks on 2 cores, comparable to the 1-thread ceiling

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=a["timeout"]))
    cfg = bunsan.models.get_preset(a["preset"])
    torch.manual_seed(0)  # same initial weights in every contender and rank
    model = bunsan.models.Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    batches = make_batches(a["warmup"] + a["steps"], rank, a["micro_batch"], a["seq"], cfg.vocab_size)
    extra: dict = {}

    if contender == "bunsan":
        engine = bunsan.initialize(model, {"train_micro_batch_size_per_gpu": a["micro_batch"],
                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})

        def step(x, y) -> float:
            return engine.train_batch({"input_ids": x, "labels": y})  # already the global mean loss
    else:
        net = torch.nn.parallel.DistributedDataParallel(model) if contender == "ddp" else model
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def step(x, y) -> float:
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()  # bunsan's train_batch returns a float too: same sync per step

    loss, elapsed = timed_steps(step, batches, a["warmup"], world, average_loss=contender == "ddp")
    if contender == "bunsan":
        mem = engine.memory_report()
        extra = {"model_states": mem["model_states"], "theory_model_states": mem["theory_model_states"],
                 "comm_step_bytes": sum(v["bytes"] for v in engine.comm_stats()["step"].values())}
    res = {"rank": rank, "tokens_per_s": a["micro_batch"] * a["seq"] * a["steps"] / elapsed,
           "peak_rss": peak_rss_bytes(),
           "loss": loss, "n_params": n_params, "grad_bytes": n_params * 4, **extra}
    leave_result(outdir, contender, rank, res, world)


def leave_result(outdir: str, name: str, rank: int, res: dict, world: int) -> None:
    """A worker's last act: its figures as OUTDIR/NAME-RANK.json (spawn_ranks reads them), then, with peers,
    a barrier (no rank tears down while another still writes) and the process group's end."""
    with open(os.path.join(outdir, f"{name}-{rank}.json"), "w") as f:
        json.dump(res, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def timed_steps(step, batches, warmup: int, world: int, average_loss: bool) -> tuple[float, float]:
    """Run `warmup` untimed steps, then time the rest (all ranks start the clock together).
    Returns (last loss, seconds). average_loss: the peers report a rank-local loss; bunsan's train_batch
    reports the global mean, so the peers' losses are averaged over ranks (equal token counts per rank)."""
    for x, y in batches[:warmup]:
        step(x, y)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:
        loss = step(x, y)
    elapsed = time.perf_counter() - t0
    if average_loss and world > 1:
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t)
        loss = t.item() / world
    return loss, elapsed


def run_one_by_one(contenders, run_contender, args, console, on_failure, rounds: int = 1) -> dict:
    """Each contender in turn (never two on the cores at once); a failure becomes on_failure(exception).
    rounds > 1: the whole field again, round after round, so that a slow spell of the machine hits every
    contender alike; each rank's tokens_per_s becomes its median over the rounds, peak_rss its maximum,
    and rank 0's result lists every round's summed tokens/s ("round_tokens_per_s"), or slowest rank's
    "elapsed" ("round_elapsed"), likewise the median of the rounds."""
    per_round: dict = {c: [] for c in contenders}
    failed: dict = {}
    for k in range(rounds):
        for c in contenders:
            if c in failed:
                continue
            t0 = time.perf_counter()
            try:
                per_round[c].append(run_contender(c, args))
                console.print(f"  {c}: done in {time.perf_counter() - t0:.1f} s"
                              + (f" (round {k + 1}/{rounds})" if rounds > 1 else ""))
            except Exception as e:
                failed[c] = on_failure(e)
                print(f"{c} FAILED:\n{traceback.format_exc()}", file=sys.stderr)
    return {c: failed[c] if c in failed else merge_rounds(per_round[c]) for c in contenders}


def merge_rounds(runs: list[list[dict]]) -> list[dict]:
    """One result per rank from several rounds of the same contender (see run_one_by_one)."""
    if len(runs) == 1:
        return runs[0]
    merged = [dict(r) for r in runs[-1]]
    for i, r in enumerate(merged):
        for key in ("tokens_per_s", "elapsed", "bubble", "bubble_sim"):   # bench_pp's bubbles too
            if all(isinstance(run[i].get(key), (int, float)) for run in runs):
                r[key] = statistics.median(run[i][key] for run in runs)
        if "peak_rss" in r:
            r["peak_rss"] = max(run[i]["peak_rss"] for run in runs)
    if "tokens_per_s" in merged[0]:
        merged[0]["round_tokens_per_s"] = [sum(x["tokens_per_s"] for x in run) for run in runs]
    if "elapsed" in merged[0]:
        merged[0]["round_elapsed"] = [max(x["elapsed"] for x in run) for run in runs]
    return merged


def contender_list(p: argparse.ArgumentParser, text: str, known) -> list[str]:
    """--contenders' comma list, checked against `known` (a parser error names the unknown ones)."""
    contenders = [c.strip() for c in text.split(",") if c.strip()]
    if unknown := [c for c in contenders if c not in known]:
        p.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return contenders


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, contender: str, world: int, args: argparse.Namespace, extra: tuple = ()) -> list[dict]:
    """Run worker(rank, contender, *extra, port, vars(args), outdir) on `world` spawned ranks, wait at most
    --timeout seconds, return the JSON each rank wrote to outdir/{contender}-{rank}.json. A worker's exception
    re-raises here with its traceback (and the other ranks are terminated); a hang is killed."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(worker, args=(contender, *extra, free_port(), vars(args), outdir),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                        p.join()
                raise TimeoutError(f"{contender}: not finished after {args.timeout:.0f} s (--timeout); killed")
        return [json.load(open(os.path.join(outdir, f"{contender}-{r}.json"))) for r in range(world)]


def run_contender(contender: str, args: argparse.Namespace) -> list[dict]:
    return spawn_ranks(_worker, contender, WORLD[contender], args, extra=(WORLD[contender],))


def build_rows(results: dict[str, list[dict]]) -> tuple[list[str], list[list[str]]]:
    header = ["contender", "ranks", "tokens/s (sum)", "vs ceiling", "vs DDP", "peak RSS/rank GiB (max)",
              "model states GiB (meas/theory)", "comm bytes/step (meas/theory)", "final loss"]
    tps = {c: sum(r["tokens_per_s"] for r in rs) for c, rs in results.items() if rs}
    ceiling = 2 * tps["single"] if "single" in tps else None
    rows = []
    for c, rs in results.items():
        if not rs:
            rows.append([c, str(WORLD[c]), "FAILED"] + ["-"] * (len(header) - 3))
            continue
        r0, n = rs[0], len(rs)
        states = comm = "-"
        if c == "bunsan":
            states = f"{r0['model_states'] / GiB:.3f} / {r0['theory_model_states'] / GiB:.3f}"
            theory = 2 * (n - 1) / n * r0["grad_bytes"]  # ring all-reduce of the fp32 gradients
            comm = f"{r0['comm_step_bytes'] / 1e6:,.2f} / {theory / 1e6:,.2f} MB ({r0['comm_step_bytes'] / theory:.2f}x)"
        rows.append([c, str(n), f"{tps[c]:,.0f}",
                     f"{tps[c] / ceiling:.2f}" if ceiling else "n/a",
                     f"{tps[c] / tps['ddp']:.2f}" if "ddp" in tps else "n/a",
                     f"{max(r['peak_rss'] for r in rs) / GiB:.3f}", states, comm, f"{r0['loss']:.4f}"])
    return header, rows


def cpu_model() -> str:
    """The CPU's model name (Linux), which moves every figure: the machine may differ from run to run."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine() -> str:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    cpu = cpu_model()
    return (f"{platform.processor() or platform.machine()}{f' ({cpu})' if cpu else ''}, {os.cpu_count()} CPUs, "
            f"{ram:.1f} GiB RAM, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def markdown_section(title: str, notes: list[str], header: list[str], rows: list[list[str]]) -> str:
    """A RESULTS.md section: the title, date, machine and command, `notes` as more bullets, then the table."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {title}", "", f"- date: {now}", f"- machine: {machine()}",
             f"- command: `python {shlex.join(sys.argv)}`", *(f"- {n}" for n in notes), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n\n"


def print_section(text: str, markdown: str | None) -> None:
    """Print a markdown_section, and append it to the file `markdown` when one is given (--markdown)."""
    print(text)
    if markdown:
        with open(markdown, "a") as f:
            f.write(text)


def write_markdown(path: str, header: list[str], rows: list[list[str]], args: argparse.Namespace) -> None:
    title = f"Data parallelism: bunsan vs DDP vs single ({args.preset}, seq {args.seq}, micro-batch {args.micro_batch})"
    notes = [f"{args.steps} timed step(s) after {args.warmup} warm-up step(s); ceiling = 2 x single-process "
             "1-thread tokens/s; comm theory = 2(N-1)/N x fp32 gradient bytes"]
    with open(path, "a") as f:
        f.write(markdown_section(title, notes, header, rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="135m", help="bunsan.models preset (default 135m: SmolLM-135M shape)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the clock starts")
    p.add_argument("--contenders", default="single,ddp,bunsan", help="comma list of single, ddp, bunsan")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per contender before its ranks are killed")
    p.add_argument("--markdown", metavar="PATH", help="append a markdown section with the table to PATH")
    args = p.parse_args(argv)
    contenders = contender_list(p, args.contenders, WORLD)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    bunsan.models.get_preset(args.preset)  # fail fast on a typo, before spawning anything (its error lists the presets)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

    from rich.console import Console
    from rich.table import Table
    console = Console(width=max(160, Console().width))  # the table is wide; never truncate its cells
    console.print(f"[bold]bench_dp[/]: preset {args.preset}, seq {args.seq}, micro-batch {args.micro_batch}, "
                  f"{args.warmup}+{args.steps} steps; {machine()}")
    results = run_one_by_one(contenders, run_contender, args, console, on_failure=lambda e: [])
    failed = any(not r for r in results.values())

    header, rows = build_rows(results)
    table = Table(title="data parallelism, CPU/gloo")
    for h in header:
        table.add_column(h, justify="left" if h == "contender" else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    if args.markdown:
        write_markdown(args.markdown, header, rows, args)
        console.print(f"appended to {args.markdown}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
