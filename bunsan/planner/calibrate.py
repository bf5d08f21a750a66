"""`plan --calibrate FILE`: fit the cost model's two scales to steps you measured, then plan with them.

FILE is JSON: a list of runs of the plan's model on its GPUs, sequence and global batch, each a layout as
`plan --explain` takes it and what it measured:

    [{"layout": "tp=8,pp=2,zero=1,mb=1", "step_s": 1.42}, {"layout": "dp=16,zero=3", "tokens_per_s": 9.1e4}]

Each run is priced as the search prices a layout, and its step split in two: the compute side (GEMMs,
attention, recompute, the bubble and the optimizer step, which all scale with how fast the GPU computes)
and the communication side (tensor-, data-, pipeline- and context-parallel traffic, which scales with the
links). Least squares then gives a scale for each, measured = a * compute + b * communication + offload;
one run (or runs without traffic) fits a alone. From there the GEMM efficiency and the links' bandwidth
scale are refined on the priced steps themselves (memory-bound kernels do not follow the GEMM efficiency, nor
does exposed traffic follow the links linearly), minimising the runs' squared log errors; the plan is then
searched again with them, and each run's error before and after is printed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from bunsan.planner.constants import GEMM_EFFICIENCY
from bunsan.planner.explain import parse_layout
from bunsan.planner.search import Candidate, Plan

COMPUTE_SIDE = ("compute", "recompute", "bubble", "optimizer")
COMM_SIDE = ("tp_comm", "dp_comm", "pp_comm", "cp_comm")


@dataclass
class Run:
    layout: str
    step_s: float | None = None
    tokens_per_s: float | None = None


@dataclass
class Calibration:
    compute_scale: float          # a: measured compute side / priced
    comm_scale: float             # b: measured communication / priced (1.0 when not fitted)
    efficiency: float             # the GEMM efficiency the fit implies
    runs: list[tuple[str, float, float]]    # (layout, measured step s, priced step s before the fit)

    def to_json(self) -> dict:
        return {"compute_scale": self.compute_scale, "comm_scale": self.comm_scale, "efficiency": self.efficiency,
                "runs": [{"layout": t, "measured_step_s": m, "priced_step_s_before": p} for t, m, p in self.runs]}


def read_runs(path: str) -> list[Run]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--calibrate {path}: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"--calibrate {path}: a JSON list of runs, each {{\"layout\": ..., \"step_s\": ...}} "
                         "or {\"layout\": ..., \"tokens_per_s\": ...}")
    runs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("layout"), str) or \
                sum(isinstance(item.get(k), (int, float)) and item[k] > 0 for k in ("step_s", "tokens_per_s")) != 1:
            raise ValueError(f"--calibrate {path}: run {i} is {item!r}; give its layout (a string) and one positive "
                             "step_s or tokens_per_s")
        runs.append(Run(item["layout"], item.get("step_s"), item.get("tokens_per_s")))
    return runs


def _sides(c: Candidate) -> tuple[float, float, float]:
    step = c.step
    return (sum(getattr(step, n) for n in COMPUTE_SIDE), sum(getattr(step, n) for n in COMM_SIDE), step.offload)


def fit(plan: Plan, runs: list[Run], efficiency: float | None) -> Calibration:
    """The two scales from `runs`, priced against `plan`'s model, GPUs and links."""
    unpriced = ValueError("--calibrate fits the step-time model, which bunsan prices for Llama-shaped models only "
                          "(bunsan's Llama, and Qwen2, Mistral, Gemma, Qwen3 and Llama language models without "
                          "encoders, at rows within their sliding window)")
    if plan.pricing is None:
        raise unpriced
    rows, measured = [], []
    for run in runs:
        c = plan.pricing.price(parse_layout(run.layout, plan))
        if c.step is None:
            raise unpriced
        seconds = run.step_s if run.step_s is not None else c.step.tokens_per_step / run.tokens_per_s
        rows.append((run.layout, seconds, c))
        measured.append(seconds)
    sides = [_sides(c) for _, _, c in rows]
    y = [m - off for m, (_, _, off) in zip(measured, sides)]
    a, b = _least_squares([s[0] for s in sides], [s[1] for s in sides], y)
    if a <= 0:
        raise ValueError("--calibrate: the measured steps are shorter than their communication and offload alone; "
                         "check that the runs are of this model, GPU count, sequence and global batch")
    base = GEMM_EFFICIENCY if efficiency is None else efficiency
    # the linear split is a start: memory-bound kernels do not scale with the GEMM efficiency, nor exposed
    # data-parallel traffic with the links; refine both on the priced steps themselves
    eff, b = _refine(plan, [c.layout for _, _, c in rows], measured, min(1.0, base / a), b, fit_links=b != 1.0)
    return Calibration(base / eff, b, eff, [(t, m, c.step.total) for t, m, c in rows])


def _refine(plan: Plan, layouts: list, measured: list[float], eff: float, b: float, fit_links: bool):
    """(efficiency, link scale) minimising the runs' squared log errors, by a grid around the start, twice."""
    import math

    from bunsan.planner.cost import step_time
    p = plan.pricing

    def error(e: float, k: float) -> float:
        intra, inter = (dataclasses.replace(link, bytes_per_s=link.bytes_per_s / k) for link in (p.intra, p.inter))
        return sum(math.log(step_time(p.shape.timed_as(lay.seq_len), lay, p.gpu, intra, inter, p.per_node, e,
                                      p.attention, p.compiled, p.overlap, p.shape.qk_norm).total / m) ** 2
                   for lay, m in zip(layouts, measured))
    span = 4.0
    for _ in range(3):
        effs = [min(1.0, eff * span ** (i / 10 - 1)) for i in range(21)]
        ks = [b * span ** (i / 10 - 1) for i in range(21)] if fit_links else [1.0]
        eff, b = min(((e, k) for e in effs for k in ks), key=lambda ek: error(*ek))
        span = span ** 0.25
    return eff, b


def _least_squares(x1: list[float], x2: list[float], y: list[float]) -> tuple[float, float]:
    """(a, b) minimising sum (a x1 + b x2 - y)^2 with b > 0; b = 1 where the runs cannot tell it apart."""
    s11, s22 = sum(v * v for v in x1), sum(v * v for v in x2)
    s12 = sum(u * v for u, v in zip(x1, x2))
    s1y, s2y = sum(u * v for u, v in zip(x1, y)), sum(u * v for u, v in zip(x2, y))
    det = s11 * s22 - s12 * s12
    if len(y) >= 2 and s22 > 0 and det > 1e-12 * s11 * s22:
        a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if b > 0:
            return a, b
    return (s1y - s12) / s11 if s11 else 0.0, 1.0      # b = 1: a alone, the links as priced


def scaled_links(plan: Plan, comm_scale: float):
    """The plan's links with their bandwidth divided by the fitted scale."""
    p = plan.pricing
    return tuple(dataclasses.replace(link, bytes_per_s=link.bytes_per_s / comm_scale) for link in (p.intra, p.inter))
