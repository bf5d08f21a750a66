"""Every constant the cost model prices a step with, each with where it comes from.

GPU peaks, HBM and link bandwidths live in bunsan/estimator/hardware.py (datasheets); this table holds the
figures that say how much of those peaks real kernels and collectives reach, and what overlaps. `SOURCES`
is the table the planner prints (`bunsan plan` assumptions, README "What the planner assumes").
"""

from __future__ import annotations

# Fraction of the tensor-core peak a large, well-shaped GEMM sustains (cuBLAS, 16-bit, A100/H100). Smaller or
# skinnier GEMMs fall below it through the roofline (their bytes over HBM), not through this number.
GEMM_EFFICIENCY = 0.80
# Fraction of the datasheet HBM bandwidth a streaming (element-wise) kernel reaches.
HBM_EFFICIENCY = 0.80
# Element-wise passes over the block's hidden state per layer in forward, each a read or a write of
# tokens x hidden: two RMSNorms (read + write each), two residual adds (two reads + one write each), rotary
# embedding on q and k (about two); under sequence parallelism each rank runs them on its 1/tp of the tokens.
HIDDEN_PASSES = 12
# SwiGLU's element-wise part: reads gate and up, writes their product (per element of tokens x I / tp).
MLP_ACT_PASSES = 3
# A materialised attention (no flash kernel: Megatron-LM 2021, BLOOM 2022): the scores written by QK^T, read
# and written by scale + mask + softmax (fused), read and written by dropout with its mask, read by the
# product with V: about 6 passes over micro-batch x heads/tp x seq^2.
SCORE_PASSES = 6
# Backward of an element-wise op reads the saved input and the incoming gradient and writes one gradient:
# about twice the forward's bytes; a GEMM's backward is two GEMMs of the forward's size.
BACKWARD_FACTOR = 2.0
# AdamW step on the rank's fp32 shard, bytes per parameter moved through HBM: master weight, two moments
# (read + write, 4 bytes each), the fp32 gradient read, the 16-bit weight written.
OPTIMIZER_BYTES_PER_PARAM = 3 * 2 * 4 + 4 + 2
# NCCL's ring latency model (src/graph/tuning.cc, NCCL 2.8-2.12, ring / Simple protocol): a base latency
# per collective plus a per-step latency, NVLink and network steps priced apart (hardware.py's links).
NCCL_BASE_LATENCY_S = 8.4e-6
# A transformer block is one ZeRO-3 unit (bunsan/zero/stage3.py): its gather is prefetched while the block
# before computes, so each gather hides behind one block's compute at most; what exceeds it is exposed.
ZERO3_PREFETCH_DEPTH = 1
# Gradient buckets reduce while backward runs; the last bucket's reduce finds no compute left to hide
# behind. bunsan's bucket is one block's gradients (zero/buckets.py), so 1 / layers of the traffic.
LAST_BUCKET_EXPOSED = True

SOURCES = (
    ("GEMM_EFFICIENCY", GEMM_EFFICIENCY, "cuBLAS large 16-bit GEMMs on A100/H100 reach ~80% of the dense "
     "peak (NVIDIA Deep Learning Performance guide, matrix multiplication background); checked against "
     "Megatron-LM Table 1's 1.7B row (benchmarks/bench_planner.py)"),
    ("HBM_EFFICIENCY", HBM_EFFICIENCY, "streaming kernels reach 80-90% of the datasheet HBM bandwidth "
     "(STREAM-like copy on A100/H100)"),
    ("HIDDEN_PASSES", HIDDEN_PASSES, "counted from bunsan's Llama block (models/blocks.py): norms, residuals, "
     "rotary"),
    ("MLP_ACT_PASSES", MLP_ACT_PASSES, "counted: SwiGLU reads gate and up, writes one"),
    ("SCORE_PASSES", SCORE_PASSES, "counted from Megatron-LM's unfused-attention path (only when "
     "attention='materialized')"),
    ("BACKWARD_FACTOR", BACKWARD_FACTOR, "a GEMM's backward is two GEMMs of its size (dgrad, wgrad)"),
    ("OPTIMIZER_BYTES_PER_PARAM", OPTIMIZER_BYTES_PER_PARAM, "counted: fused AdamW on an fp32 shard"),
    ("NCCL_BASE_LATENCY_S", NCCL_BASE_LATENCY_S, "NCCL src/graph/tuning.cc baseLat, ring / Simple"),
    ("ZERO3_PREFETCH_DEPTH", ZERO3_PREFETCH_DEPTH, "bunsan/zero/stage3.py prefetches the next unit only"),
)
