"""bunsan's own training runs on a GPU (the self-check, `bash scripts/gpu-check`), priced by the planner: held out
from every constant's fit, like MosaicML's runs (published_mpt.py).

Source: benchmarks/RESULTS.md, "GPU self-check (issue #19)": 2026-12-05 19:45 UTC, commit c294570, one NVIDIA
H100 80GB HBM3 (SXM; the board's power limit was not recorded: 700 W, its default, assumed), torch 2.11.0+cu130.
The throughput section's runs: bunsan's 1b preset (Llama 3.2 1B's shape: hidden 2,048, 16 layers, GQA 32/8,
intermediate 8,192, vocabulary 128,256, tied embedding), sequence 2,048, one GPU (no data parallelism, ZeRO 0),
bf16 with fp32 master weights and AdamW, SDPA's flash kernel; eager and `train.compile` (each block compiled),
activation checkpointing off (micro-batch 8) and on (every block recomputed, micro-batch 16): tokens per second
measured over 5 steps after 2 of warm-up.

Priced, not ranked: one GPU leaves the search only micro-batch and recompute to choose.
"""

from __future__ import annotations

from published_runs import Run

from bunsan.estimator.layout import Layout
from bunsan.models.presets import build_config

SOURCE = "benchmarks/RESULTS.md GPU self-check, 2026-12-05, commit c294570"
MODEL = build_config("1b")


def _run(name: str, micro: int, checkpointing: bool, compiled: bool, measured: float) -> Run:
    layout = Layout(dp=1, zero=0, micro_batch=micro, grad_accum=1, seq_len=2048, precision="bf16",
                    checkpointing="full" if checkpointing else "none")
    return Run(f"bunsan 1B {name}, 1 H100", SOURCE, MODEL, 1, micro, layout, measured, "infiniband", "bf16",
               gpu="h100", ranked=False, intra="nvlink", attention="flash", compiled=compiled, count="tokens",
               group="bunsan on H100 2026 (held out)")


RUNS = (
    _run("eager", 8, False, False, 42738.7),
    _run("eager checkpointing", 16, True, False, 37197.6),
    _run("compiled", 8, False, True, 55008.5),
    _run("compiled checkpointing", 16, True, True, 49785.7),
)
