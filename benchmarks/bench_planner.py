"""The planner against published large runs: does it price and pick what their authors ran?

    python benchmarks/bench_planner.py [--full]

For each run of tests/published_runs.py (Megatron-LM 2021 Tables 1 and 2, BigScience BLOOM-176B) it prints
the published layout and measured TFLOP/s per GPU, the planner's predicted TFLOP/s for that layout (the
paper's FLOP count over the planner's step time), its rank among the layouts the authors' software could
run (`--full`: among every layout bunsan runs, slower), and the planner's first choice. Then Table 2's
ZeRO-3 decline (384 -> 768 -> 1536 GPUs) as measured and as predicted. Targets (issue #26): the published
layout first or within 5% of the first choice; its predicted throughput within 15% of the measured; the
ZeRO-3 decline within 20%. Runs on a CPU in about a minute (`--full`, which adds context parallelism,
ZeRO under pipeline stages and the rest: about a quarter of an hour on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def table(full: bool) -> list[str]:
    import published_runs as pr
    from bunsan.planner.space import Space
    rows = ["| run | source | published layout | measured TFLOP/s | predicted | error | rank | behind first | "
            "first choice (predicted TFLOP/s) |", "|---|---|---|---|---|---|---|---|---|"]
    for run in (r for r in pr.RUNS if r.ranked):
        r = pr.reproduce(run, space=Space() if full else None)
        rank = f"{r.rank} of {r.ranked}" if r.rank else f"not ranked (of {r.ranked})"
        behind = f"{r.behind_first:.1%}" if r.behind_first is not None else "-"
        first = f"{r.first.describe()} ({r.first_tflops:.0f})" if r.first else "nothing fits"
        rows.append(f"| {run.name} | {run.source} | {run.layout.describe()} | {run.measured_tflops:g} | "
                    f"{r.predicted_tflops:.0f} | {r.error:+.1%} | {rank} | {behind} | {first} |")
    return rows


def zero3_decline() -> list[str]:
    import published_runs as pr
    runs = [pr.reproduce(r, search=False) for r in pr.RUNS if not r.ranked]
    base = runs[0]
    rows = ["| run | measured TFLOP/s | predicted | error | measured / 384-GPU row | predicted / 384-GPU row | "
            "decline error |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        meas = r.run.measured_tflops / base.run.measured_tflops
        pred = r.predicted_tflops / base.predicted_tflops
        rows.append(f"| {r.run.name} | {r.run.measured_tflops:g} | {r.predicted_tflops:.0f} | {r.error:+.1%} | "
                    f"{meas:.2f} | {pred:.2f} | {pred / meas - 1:+.1%} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="rank among every layout bunsan runs, not only the "
                    "authors' options")
    args = ap.parse_args(argv)
    print("\n".join(table(args.full)))
    print()
    print("\n".join(zero3_decline()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
