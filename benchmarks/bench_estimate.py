"""Estimate vs measurement, and the planner's ranking vs measured throughput, on CPU (gloo, 2 ranks).

    python benchmarks/bench_estimate.py [--skip-sweep] [--skip-ranking] [--top 6] [--steps 4]

Part 1 runs the 14 layouts of tests/estimate_runs.py (a 20M-parameter Llama, fresh processes per layout)
and prints estimated vs measured model states and peak resident set per rank. Part 2 asks the planner for
the layouts of the same model on 2 CPU "GPUs", measures the throughput of its top choices and reports
whether its first choice measures within 10% of the best of them.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

GiB = 1024 ** 3


def sweep(pools) -> list[str]:
    import estimate_runs as er
    rows = ["| layout | rank | states est GiB | states meas GiB | err | peak est GiB | peak meas GiB | err | "
            "above runtime est/meas GiB | err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, world, extra in er.LAYOUTS:
        try:
            res = pools.run(world, er.run_layout, extra)
        finally:
            pools.discard(world)
        for r in res[:1] if "pipeline" not in extra else res:
            e = er.estimate_for(extra, world, r["baseline"])
            st, pk = e.stage_states[r["pp_rank"]]["model_states"], e.stage_peaks[r["pp_rank"]]
            above_e, above_m = pk - r["baseline"], r["peak"] - r["baseline"]
            rows.append(f"| {name} | {r['pp_rank']} | {st / GiB:.3f} | {r['model_states'] / GiB:.3f} | "
                        f"{st / r['model_states'] - 1:+.1%} | {pk / GiB:.3f} | {r['peak'] / GiB:.3f} | "
                        f"{pk / r['peak'] - 1:+.1%} | {above_e / GiB:.3f} / {above_m / GiB:.3f} | "
                        f"{above_e / above_m - 1:+.1%} |")
            print(rows[-1], flush=True)
    return rows


def ranking(pools, top: int, steps: int) -> list[str]:
    import estimate_runs as er
    from bunsan.models.llama import LlamaConfig
    from bunsan.planner.search import plan
    p = plan(LlamaConfig(**er.MODEL), 2, 8 * GiB, gpu="cpu", seq_len=er.SEQ, global_batch=8, device_type="cpu",
             keep=1000)
    # The first choice, then the best-ranked layout of each other kind (parallelism, ZeRO, offload, recompute).
    kinds, picked = set(), []
    for c in p.ranked:
        lay = c.layout
        kind = (lay.dp, lay.tp, lay.pp, lay.zero, lay.offload_optimizer, lay.offload_param, lay.checkpointing)
        if kind not in kinds:
            kinds.add(kind)
            picked.append((p.ranked.index(c) + 1, c))
        if len(picked) == top:
            break
    rows = ["| planner rank | layout | est. step s | est. tokens/s | measured tokens/s | measured / best |",
            "|---|---|---|---|---|---|"]
    measured = []
    for _, c in picked:
        cfg = c.layout.to_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        try:
            res = pools.run(2, er.run_layout, cfg, steps)
        finally:
            pools.discard(2)
        secs = max(r["seconds"] for r in res)
        measured.append(res[0]["tokens"] / secs)
        print(c.layout.describe(), f"{measured[-1]:.0f} tok/s", flush=True)
    best = max(measured)
    for (k, c), m in zip(picked, measured):
        rows.append(f"| {k} | {c.layout.describe()} | {c.step.total:.3g} | {c.step.tokens_per_s:,.0f} | "
                    f"{m:,.0f} | {m / best:.2f} |")
    verdict = "within" if measured[0] >= 0.9 * best else "NOT within"
    rows.append("")
    rows.append(f"First choice measures {measured[0] / best:.2f} of the best measured: {verdict} 10%. "
                f"Rank correlation is what the table shows; {p.considered} layouts priced, {p.too_big} too big.")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--skip-ranking", action="store_true")
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    from dist_harness import Pools
    pools = Pools()
    print(f"# bench_estimate {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, {os.cpu_count()} CPUs")
    try:
        out = [] if args.skip_sweep else sweep(pools)
        if not args.skip_ranking:
            out += [""] + ranking(pools, args.top, args.steps)
    finally:
        pools.close()
    print("\n".join(out))


if __name__ == "__main__":
    main()
