"""Every constant the cost model prices a step with, each with where it comes from.

GPU peaks, HBM and link bandwidths live in bunsan/estimator/hardware.py (datasheets); this table holds the
figures that say how much of those peaks real kernels and collectives reach, and what overlaps. `SOURCES`
is the table the planner prints (`bunsan plan` assumptions, README "What the planner assumes").
"""

from __future__ import annotations

from bunsan.estimator import hardware

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
# HIDDEN_PASSES and MLP_ACT_PASSES are fused ops (torch.compile, `train.compile`; Megatron's fused kernels):
# each reads its inputs and writes its output once. Eager PyTorch runs each op of bunsan's block as a kernel of
# its own, each a pass over HBM; counted from the code in 16-bit passes over tokens x hidden (fp32: two):
# RMSNorm (models/saving.py) x.float() 1+2, pow 2+2, mean 2, the in-place multiply by rstd 2+2, back to 16-bit
# 2+1, the weight's multiply 1+1: 18, two per block 36; two residual adds (two reads + one write) 6.
EAGER_HIDDEN_PASSES = 42
# Eager rotary embedding (models/llama.py apply_rope) per element of q and k (tokens x (heads + key/value heads)
# x head_dim / tp): x * cos 1+1, rotate_half's negation 0.5+0.5 and concatenation 1+1, * sin 1+1, the sum 2+1.
EAGER_ROPE_PASSES = 10
# Eager SwiGLU (models/saving.py swiglu): silu(gate) 1+1, times up 2+1. (Kernel launches are not priced.)
EAGER_MLP_ACT_PASSES = 5
# A MoE block's dispatch (models/moe_dispatch.py), per routed assignment x hidden, eager or compiled (indexing ops
# stay kernels of their own): the gather by expert 1+1, the weighting 1+1, the scatter back 1+1, the sum over
# the top-k 1 (its output is 1/k as large): counted from the code.
MOE_DISPATCH_PASSES = 7
# A materialised attention (no flash kernel: Megatron-LM 2021, BLOOM 2022): the scores written by QK^T, read
# and written by scale + mask + softmax (fused), read and written by dropout with its mask, read by the
# product with V: about 6 passes over micro-batch x heads/tp x seq^2.
SCORE_PASSES = 6
# Backward of an element-wise op reads the saved input and the incoming gradient and writes one gradient:
# about twice the forward's bytes; a GEMM's backward is two GEMMs of the forward's size.
BACKWARD_FACTOR = 2.0
# Eager PyTorch's backward of bunsan's block moves more: counted by a dispatch mode over every aten op of one
# block's forward and backward (tests/test_planner_passes.py; bf16, fresh gradients), the element-wise ops'
# backward reads and writes 2.45x their forward's bytes in the 1B preset, 2.46x in 135M and 2.34x in Llama 2
# 7B (MHA), where their forward is the EAGER_* count within 1% (the backward's ops per block, counted: 24
# multiplies, 9 adds, 8 dtype casts, 4 sums, 2 each of cat, clone, div, neg and pow, SiLU's and its backward).
EAGER_BACKWARD_FACTOR = 2.4
# AdamW step on the rank's fp32 shard, bytes per parameter moved through HBM: master weight, two moments
# (read + write, 4 bytes each), the fp32 gradient read, the 16-bit weight written.
OPTIMIZER_BYTES_PER_PARAM = 3 * 2 * 4 + 4 + 2
# A flash attention kernel's throughput by the query rows one call runs, as a fraction of its long-row plateau:
# FlashAttention-2 (Dao 2023, arXiv:2307.08691) Figure 4 (A100, forward + backward, causal, head dim 128, 16k
# tokens per batch) and Figure 7 (H100, same shape) rise from about half the 16k figure at 512 tokens to within
# a few percent by 8k, as fewer key blocks per query block leave the kernel's per-block work (loading Q, the
# softmax rescale, writing O, the diagonal block's mask) less to amortise over. The figures are approximate
# readings of the plotted bars (not re-measured: no GPU has been lent). Context parallelism cuts a row into
# chunks of seq / (2 cp) queries (context_parallel/attention.py runs the rank's two chunks one call each), so
# the planner prices its attention at this curve's figure for the chunk over the figure for the whole row
# (compute.py): the GEMM efficiency already holds the kernel's efficiency at the row's own length. Below 512
# tokens (no reading) the 512 figure is kept: an optimistic floor.
FLASH_BY_CHUNK = ((512, 0.50), (1024, 0.68), (2048, 0.83), (4096, 0.92), (8192, 0.97), (16384, 1.0))
# cuDNN's fused flash attention by the same measure, from the FlashAttention-3 paper's H100 figures
# (hardware.FLASH_CUDNN_HOPPER: forward + backward 308/409/470/504/521/522 TFLOP/s, 512 to 16k tokens)
CUDNN_BY_CHUNK = ((512, 0.59), (1024, 0.78), (2048, 0.90), (4096, 0.97), (8192, 1.0), (16384, 1.0))
# FlashAttention's Triton port by the same measure, from FlashAttention-2's A100 figure (hardware.FLASH_TRITON_AMPERE:
# forward + backward 50/61/68/74/78/80 TFLOP/s, 512 to 16k tokens)
TRITON_BY_CHUNK = ((512, 0.63), (1024, 0.76), (2048, 0.85), (4096, 0.93), (8192, 0.98), (16384, 1.0))
# NCCL's latencies (per collective, per ring step) and the links' bandwidths: bunsan/estimator/hardware.py.
NCCL_BASE_LATENCY_S = hardware.NCCL_BASE_LATENCY_S

SOURCES = (
    ("GEMM_EFFICIENCY", GEMM_EFFICIENCY, "cuBLAS large 16-bit GEMMs on A100/H100 reach ~80% of the dense "
     "peak (NVIDIA Deep Learning Performance guide, matrix multiplication background); checked against "
     "Megatron-LM Table 1's 1.7B row (benchmarks/bench_planner.py)"),
    ("HBM_EFFICIENCY", HBM_EFFICIENCY, "streaming kernels reach 80-90% of the datasheet HBM bandwidth "
     "(STREAM-like copy on A100/H100)"),
    ("HIDDEN_PASSES", HIDDEN_PASSES, "counted from bunsan's Llama block (models/blocks.py): norms, residuals, "
     "rotary"),
    ("MLP_ACT_PASSES", MLP_ACT_PASSES, "counted: SwiGLU reads gate and up, writes one"),
    ("EAGER_HIDDEN_PASSES / ROPE / MLP_ACT", f"{EAGER_HIDDEN_PASSES} / {EAGER_ROPE_PASSES} / {EAGER_MLP_ACT_PASSES}",
     "counted from bunsan's eager block, op by op (models/saving.py, models/llama.py); without --compile"),
    ("MOE_DISPATCH_PASSES", MOE_DISPATCH_PASSES, "counted from bunsan's MoE dispatch (models/moe_dispatch.py): "
     "gather, weighting, scatter back, sum over the top-k"),
    ("SCORE_PASSES", SCORE_PASSES, "counted from Megatron-LM's unfused-attention path (only when "
     "attention='materialized')"),
    ("FLASH_BY_CHUNK", "0.50 at 512 .. 1 at 16k", "FlashAttention-2 (arXiv:2307.08691) Figs. 4 and 7: causal "
     "forward + backward TFLOP/s by sequence length, as a fraction of the 16k figure (read approximately)"),
    ("CUDNN_BY_CHUNK", "0.59 at 512 .. 1 at 8k", "the FlashAttention-3 paper's (arXiv:2407.08608) H100 figures "
     "of cuDNN's kernel, head dim 128: forward + backward by sequence length over the 16k figure (attention 'cudnn')"),
    ("TRITON_BY_CHUNK", "0.63 at 512 .. 1 at 16k", "FlashAttention-2 (arXiv:2307.08691) Fig. 4: the Triton port's "
     "causal forward + backward TFLOP/s on A100 by sequence length over the 16k figure (attention 'triton')"),
    ("FLASH_TRITON_AMPERE", round(hardware.FLASH_TRITON_AMPERE, 3), "hardware.py: the Triton port's forward + "
     "backward on A100 at 16k (80 TFLOP/s), 0.42x FlashAttention-2 in the same figure; llm-foundry's attn_impl "
     "'triton'"),
    ("FLASH_CUDNN_HOPPER", round(hardware.FLASH_CUDNN_HOPPER, 3), "hardware.py: cuDNN's fused attention forward + "
     "backward on H100 at 16k (522 TFLOP/s), 1.60x FlashAttention-2 in the same figures; Transformer Engine's "
     "choice on Hopper"),
    ("BACKWARD_FACTOR", BACKWARD_FACTOR, "a GEMM's backward is two GEMMs of its size (dgrad, wgrad)"),
    ("EAGER_BACKWARD_FACTOR", EAGER_BACKWARD_FACTOR, "eager element-wise backward over forward bytes, counted by a "
     "dispatch mode over bunsan's block (tests/test_planner_passes.py: 2.34-2.46)"),
    ("OPTIMIZER_BYTES_PER_PARAM", OPTIMIZER_BYTES_PER_PARAM, "counted: fused AdamW on an fp32 shard"),
    ("NCCL_BASE_LATENCY_S", NCCL_BASE_LATENCY_S, "NCCL src/graph/tuning.cc baseLat, ring / Simple"),
    ("nvlink3 / hdr / omnipath", "235 / 20 / 5 GB/s", "hardware.py: NCCL's A100 bus-bandwidth cap; 80% of "
     "HDR 200 Gb/s per GPU (DGX A100); 80% of 4 x 100 Gb/s Omni-Path per 8 GPUs (Jean Zay)"),
    ("NVLink / network step", f"{hardware.NVLINK_STEP_S * 1e6:g} / {hardware.NET_STEP_S * 1e6:g} us",
     "NCCL src/graph/tuning.cc hwLat, ring / Simple"),
    ("POWER_EXPONENT", hardware.POWER_EXPONENT, "hardware.py: a board capped below its TDP sustains (cap / TDP) to "
     "this power of its peak (H100 NVL's and SXM's datasheet peaks)"),
    ("SUSTAINED_HOPPER", hardware.SUSTAINED_HOPPER, "hardware.py: what an SXM H100/H200 keeps of its peak through "
     "training steps, fitted to Megatron-Core r0.8.0's nine H100 runs (tests/test_planner_published.py)"),
)


def table() -> str:
    """The constants and their sources, one per line (`bunsan plan --constants`)."""
    return "\n".join(f"  {name:<26} {value!s:<18} {source}" for name, value, source in SOURCES)
