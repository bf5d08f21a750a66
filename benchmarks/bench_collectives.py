"""gloo collectives on CPU: torch's own vs bunsan's point-to-point exchanges and shared memory.

bunsan.comm runs all-reduce, reduce-scatter and all-gather through shared memory where a group's ranks share
a host (bunsan/comm/shm.py), else all-gather and reduce-scatter as direct exchanges on gloo (bunsan/comm/exchange.py);
this measures why: per bucket, with --in-flight buckets launched at once (as ZeRO's backward hooks and
post-step gather do), through bunsan's Comm with train.gloo_collectives 'native', 'exchange' and 'shm'.

    python benchmarks/bench_collectives.py --markdown benchmarks/RESULTS.md   # 2 ranks, 40 MB fp32 buckets
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from bench_dp import machine, spawn_ranks
from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh

OPS = ("all_reduce/native", "all_reduce/shm", "reduce_scatter/native", "reduce_scatter/exchange", "reduce_scatter/shm",
       "all_gather/native", "all_gather/exchange", "all_gather/shm")


def _worker(rank: int, contender: str, world: int, port: int, a: dict, outdir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=a["timeout"]))
    group = Mesh.create().dp_group
    n, k = a["numel"], a["in_flight"]
    fulls = [torch.randn(n) for _ in range(k)]
    shards = [torch.randn(n // world) for _ in range(k)]
    res = {}

    def one_round(name: str, comm: Comm) -> None:
        if name == "all_reduce":
            handles = [comm.all_reduce(f, group, async_op=True) for f in fulls]
        elif name == "reduce_scatter":
            handles = [comm.reduce_scatter(s, f, group, async_op=True) for s, f in zip(shards, fulls)]
        else:
            handles = [comm.all_gather(f, s, group, async_op=True) for s, f in zip(shards, fulls)]
        for h in handles:
            h.wait()

    for op in OPS * a["repeats"]:
        name, _, mode = op.partition("/")
        comm = Comm(timeout_s=a["timeout"], gloo_collectives=mode)
        one_round(name, comm)         # untimed: sets the shared memory up (once per Comm in real use)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a["rounds"]):
            one_round(name, comm)
        ms = (time.perf_counter() - t0) * 1000 / (a["rounds"] * k)
        res[op] = min(res.get(op, float("inf")), ms)   # best of --repeats: the shared machine's noise is additive
    with open(os.path.join(outdir, f"{contender}-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--numel", type=int, default=10_000_000, help="fp32 elements per bucket (default 40 MB)")
    p.add_argument("--in-flight", type=int, default=4, help="buckets launched before the first wait")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="passes over all ops, interleaved; the best counts")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--markdown", metavar="PATH")
    args = p.parse_args(argv)
    res = spawn_ranks(_worker, "collectives", args.world, args, extra=(args.world,))
    ms = {op: max(r[op] for r in res) for op in OPS}   # the slowest rank's time
    mb = args.numel * 4 / 1e6
    rows = [[op, f"{ms[op]:.1f}", f"{ms[op] / ms['all_reduce/native']:.2f}",
             f"{ms[op.split('/')[0] + '/native'] / ms[op]:.2f}x" if not op.endswith("native") else "-"] for op in OPS]
    header = ["op (gloo_collectives)", f"ms per {mb:.0f} MB bucket", "vs gloo all-reduce", "speed-up vs native"]
    table = Table(title=f"gloo collectives, {args.world} ranks, {args.in_flight} buckets in flight")
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    Console().print(table)
    if args.markdown:
        cmd = "python benchmarks/bench_collectives.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        lines = [f"## gloo collectives: torch's vs bunsan's exchanges and shared memory ({args.world} ranks)", "",
                 f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                 f"- machine: {machine()}", f"- command: `{cmd}`",
                 f"- {args.in_flight} buckets of {mb:.0f} MB fp32 in flight, {args.rounds} rounds, best of "
                 f"{args.repeats} interleaved passes, slowest rank", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
