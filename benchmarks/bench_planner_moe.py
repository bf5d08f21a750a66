"""The planner's price of a published mixture-of-experts run: NVIDIA's Grok-1 recipe on DGX H100 (NeMo, bf16).

    python benchmarks/bench_planner_moe.py

tests/published_moe.py says where every setting comes from; tests/test_moe_pricing.py pins the figures. Each row:
the recipe's layout as bunsan writes it, the measured seconds per step, the cost model's price of that layout as
bunsan's engine runs it, and the all-to-alls' share of it. No GPU needed: it prices, it does not run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import published_moe as pm  # noqa: E402


def main() -> None:
    print("| GPUs | layers | layout | measured s | priced s | priced / measured | ep_comm s |")
    print("|---|---|---|---|---|---|---|")
    for gpus in pm.ROWS:
        layout, step, measured = pm.priced(gpus)
        print(f"| {gpus} | {pm.ROWS[gpus][1]} | {layout.describe()} | {measured:.2f} | {step.total:.2f} | "
              f"{step.total / measured:.2f} | {step.ep_comm:.2f} |")


if __name__ == "__main__":
    main()
