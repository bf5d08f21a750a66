"""Kernels measured on the user's own GPU, priced in place of the constants' sources (`bunsan plan --kernels FILE`).

FILE is what benchmarks/bench_kernels.py writes, or the gpu-check.json of `scripts/gpu-check` (its kernels
section): 16-bit GEMMs by shape beside an 8192^3 reference product, and causal flash attention forward +
backward by sequence length. With it:

- a GEMM of m x k x n runs at constants.GEMM_EFFICIENCY times the measured rate of that shape over the
  reference's (capped at 1: the efficiency already holds what a large, well-shaped GEMM reaches), taken as the
  mean over a linear layer's three products (forward, dgrad, wgrad), at the measured (k, n) nearest in log
  space and interpolated in log m between the measured token counts (held flat past either end);
- the board's best-shape matmul (hardware.GPU.matmul_fraction, which scales the efficiency) is the measured
  reference product's rate over the datasheet peak;
- flash attention runs at the measured fraction of the dense peak at its best length, and by its own curve
  at shorter rows (in place of constants.FLASH_BY_CHUNK, read off FlashAttention-2's plots).

A file measured on another GPU than the one planned is refused: the curves are the board's own. The GEMMs are
measured in 16-bit; a layout priced in fp32 takes the same shape factors (its peak is the datasheet's fp32).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MeasuredKernels:
    device: str                                  # torch.cuda.get_device_name() where it was measured
    # (k, n) -> ((m, fraction of the reference product's rate: mean of forward, dgrad and wgrad), ...) by m
    gemm: dict
    flash: tuple                                 # ((seq, fraction of the best length's rate), ...) by seq
    flash_tflops: float                          # the best causal forward + backward rate (the causal half's FLOPs)
    reference_tflops: float                      # the 8192^3 product's rate: the board's best-shape matmul
    source: str = ""

    def gemm_factor(self, m: float, k: float, n: float) -> float:
        """The measured rate of an m x k x n product over the reference's, at most 1."""
        if not self.gemm:
            return 1.0
        near = min(self.gemm, key=lambda kn: (math.log(kn[0] / k)) ** 2 + (math.log(kn[1] / n)) ** 2)
        return min(1.0, log2_interpolate(self.gemm[near], m))

    def flash_at(self, rows: float) -> float:
        return log2_interpolate(self.flash, rows) if self.flash else 1.0


def log2_interpolate(points, x: float) -> float:
    """Linear in log2(x) between (x, y) points sorted by x; flat past either end (the planner's curves by
    length: constants.FLASH_BY_CHUNK, and the measured ones here)."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log2(x / x0) / math.log2(x1 / x0)
    return points[-1][1]


def read_kernels(path: str | Path) -> MeasuredKernels:
    """bench_kernels.py's JSON, or gpu-check.json's kernels rows; a clear error naming what the file lacks."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--kernels {path}: cannot read it as JSON ({e}); give the file benchmarks/bench_kernels.py "
                         "--out wrote, or scripts/gpu-check's gpu-check.json") from None
    if "rows" in data:                           # gpu-check.json: the kernels section's rows
        rows = {r["name"]: r.get("numbers", {}) for r in data["rows"] if r.get("section") == "kernels"}
        gemm = rows.get("gemm by shape", {})
        data = {"device": (data.get("machine") or {}).get("gpu"), "gemm": gemm.get("gemms"),
                "reference": {"tflops": gemm.get("reference_tflops")},
                "flash": rows.get("flash attention by length", {}).get("flash")}
    device, gemms, reference = data.get("device"), data.get("gemm"), (data.get("reference") or {}).get("tflops")
    if not device or device == "cpu":
        raise ValueError(f"--kernels {path}: measured on {device or 'an unnamed device'}, not a GPU; measure on the "
                         "GPU you plan for (bench_kernels.py there, or scripts/gpu-check)")
    if not gemms or not reference:
        raise ValueError(f"--kernels {path}: no GEMM measurements (a 'gemm' list beside 'reference.tflops'); the "
                         "kernels section of that run may have been skipped")
    by_shape: dict = {}
    for g in gemms:
        by_shape.setdefault((g["k"], g["n"]), {}).setdefault(g["m"], []).append(g["tflops"] / reference)
    curves = {kn: tuple(sorted((m, sum(v) / len(v)) for m, v in ms.items())) for kn, ms in by_shape.items()}
    causal = sorted((f["seq"], f["tflops"]) for f in data.get("flash") or [] if f.get("kind") == "causal")
    best = max((t for _, t in causal), default=0.0)
    flash = tuple((s, t / best) for s, t in causal) if best > 0 else ()
    return MeasuredKernels(device=device, gemm=curves, flash=flash, flash_tflops=best, reference_tflops=reference,
                           source=str(path))


def attach(gpu, kernels: MeasuredKernels):
    """`gpu` priced with `kernels`: refused when they were measured on another board."""
    import dataclasses

    from bunsan.estimator.hardware import gpu_spec
    try:
        measured_on = gpu_spec(kernels.device).name
    except ValueError:
        measured_on = kernels.device
    if measured_on != gpu.name:
        raise ValueError(f"--kernels {kernels.source} was measured on {kernels.device} ({measured_on}), but the plan "
                         f"is for {gpu.name}: pass --gpu {measured_on}, or measure on {gpu.name}")
    peak = gpu.peak_flops.get("bf16") or gpu.peak_flops.get("fp16")
    flash_fraction = kernels.flash_tflops * 1e12 / peak if kernels.flash_tflops else gpu.flash_fraction
    # the reference product is the board's best-shape matmul (MAMF): what gemm_scale scales the efficiency by
    return dataclasses.replace(gpu, measured=kernels, flash_fraction=flash_fraction,
                               matmul_fraction=kernels.reference_tflops * 1e12 / peak)
