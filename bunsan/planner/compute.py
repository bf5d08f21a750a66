"""Seconds of compute per transformer block and micro-batch on one rank: a roofline per GEMM.

Each GEMM of the block (q/k/v, o, gate/up, down, the attention core, the head) is priced at the slower of
its FLOPs at `gemm_efficiency` x the tensor-core peak and its bytes (both operands and the result) at the
HBM bandwidth: so tensor parallelism that makes GEMMs skinny, or micro-batches that make them short,
costs what the roofline says. The element-wise rest (norms, residuals, the activation, a materialised
softmax) moves bytes only. Under tensor parallelism the GEMMs shrink by tp; without sequence parallelism
the norms and residuals run on every rank's whole sequence (replicated), with it on 1/tp of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from bunsan.estimator.activations import routed_rows
from bunsan.estimator.hardware import GPU
from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.planner import constants as K
from bunsan.planner.kernels import log2_interpolate

# "flash": FlashAttention-2 (PyTorch SDPA's flash kernel, bunsan's); "cudnn": cuDNN's fused flash attention
# (Transformer Engine's on Hopper; measured there only); "triton": FlashAttention's Triton port (llm-foundry's
# attn_impl "triton"; measured on A100 only); "materialized": the scores written out
ATTENTION = ("flash", "cudnn", "triton", "materialized")
FLASH_KERNELS = ("flash", "cudnn", "triton")
# the kernels priced at their own published figure (a GPU field, None where unmeasured) and curve by length
OWN_CURVES = {"cudnn": K.CUDNN_BY_CHUNK, "triton": K.TRITON_BY_CHUNK}
WHERE_MEASURED = {"cudnn": "hardware.FLASH_CUDNN_HOPPER is Hopper's; Transformer Engine runs FlashAttention-2 on "
                           "other GPUs",
                  "triton": "hardware.FLASH_TRITON_AMPERE is the A100's, the only GPU the FlashAttention-2 paper "
                            "measured the port on"}


@dataclass(frozen=True)
class BlockTime:
    """One block, one micro-batch, one rank: forward and backward seconds, and the parts recompute reruns."""

    forward: float
    backward: float
    attention_forward: float      # the attention core's forward (selective recompute reruns it)
    o_proj_forward: float         # o_proj's GEMM (selective recompute reruns it under tensor parallelism)


def gemm(m: int, k: int, n: int, gpu: GPU, precision: str, dtype_bytes: int, efficiency: float,
         batch: int = 1) -> float:
    """Seconds for `batch` (m x k) @ (k x n) products: the roofline of FLOPs and HBM bytes."""
    flops = 2.0 * batch * m * k * n
    nbytes = batch * (m * k + k * n + m * n) * dtype_bytes
    if gpu.measured is not None:        # this board's own rate for the shape (planner/kernels.py)
        efficiency *= gpu.measured.gemm_factor(m, k, n)
    return max(flops / (gpu.sustained_flops(precision) * gpu.gemm_scale * efficiency),
               nbytes / (gpu.hbm_bytes_per_s * K.HBM_EFFICIENCY))


def streamed(nbytes: float, gpu: GPU) -> float:
    return nbytes / (gpu.hbm_bytes_per_s * K.HBM_EFFICIENCY)


def flash_at(tokens: float, gpu: GPU | None = None, kernel: str = "flash") -> float:
    """A flash kernel's throughput at `tokens` query rows per call, as a fraction of its long-row plateau
    (constants.FLASH_BY_CHUNK, or the curve measured on `gpu` (planner/kernels.py); cuDNN's kernel:
    constants.CUDNN_BY_CHUNK; the Triton port's: TRITON_BY_CHUNK), interpolated in log2 of the length; held flat
    past either end."""
    if kernel in OWN_CURVES:
        return log2_interpolate(OWN_CURVES[kernel], tokens)
    if gpu is not None and gpu.measured is not None and gpu.measured.flash:
        return gpu.measured.flash_at(tokens)
    return log2_interpolate(K.FLASH_BY_CHUNK, tokens)


def block_time(model: LlamaConfig, layout: Layout, gpu: GPU, efficiency: float,
               attention: str = "flash", keys: int | None = None, chunk: int | None = None,
               compiled: bool = False) -> BlockTime:
    """Seconds for one block's forward and backward on one micro-batch on one tensor-parallel rank.
    `keys`: the row length the queries attend to, when it is longer than the rank's `layout.seq_len`
    tokens (context parallelism: each rank's queries against the whole row's keys). `chunk`: the query rows
    one attention call runs when context parallelism cuts them shorter than the row (`keys`): flash attention
    then runs at flash_efficiency's figure for the chunk (flash_at(chunk)). `compiled`: torch.compile's fused
    element-wise ops (`train.compile`), else eager PyTorch's, an HBM pass per op (constants.EAGER_*)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}; 'flash' for "
                         "FlashAttention-2 (bunsan's SDPA), 'cudnn' for cuDNN's fused kernel (Transformer Engine's "
                         "on Hopper), 'triton' for FlashAttention's Triton port (llm-foundry's), 'materialized' "
                         "when the scores are written out")
    check_kernel(attention, gpu)
    t, b, s, h = layout.tp, layout.micro_batch, layout.seq_len, model.hidden_size
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    d, inter, p, nb = model.head_dim, model.intermediate_size, layout.precision, layout.dtype_bytes
    tokens = b * s

    def mm(m, k, n, batch=1):
        return gemm(m, k, n, gpu, p, nb, efficiency, batch)

    qkv = mm(tokens, h, (heads + 2 * kv) * d // t)
    o_proj = mm(tokens, heads * d // t, h)
    if model.moe is None:
        mlp, act, dispatch = mm(tokens, h, 2 * inter // t) + mm(tokens, inter // t, h), tokens * inter / t, 0.0
    else:
        mlp, act, dispatch = _moe_mlp(model, layout, tokens, mm)
    core = _attention_core(b, s, keys or s, heads // t, kv // t or 1, d, gpu, p, nb,
                           flash_efficiency(gpu, efficiency, chunk or s, keys or s, attention)
                           if attention in FLASH_KERNELS else efficiency, attention)
    hidden_tokens = tokens / (t if layout.sequence_parallel else 1)
    if compiled:        # (a MoE block's experts run eagerly inside the compiled block: transforms/compile.py)
        passes = K.HIDDEN_PASSES * hidden_tokens * h + \
            (K.MLP_ACT_PASSES if model.moe is None else K.EAGER_MLP_ACT_PASSES) * act
    else:       # (rotary runs on the rank's q and k heads, split by tp whatever sequence parallelism does)
        passes = (K.EAGER_HIDDEN_PASSES * hidden_tokens * h + K.EAGER_ROPE_PASSES * tokens * (heads + kv) * d / t
                  + K.EAGER_MLP_ACT_PASSES * act)
    passes += dispatch
    elementwise = streamed(passes * nb, gpu)
    forward = qkv + o_proj + mlp + core + elementwise
    # GEMMs and the attention kernel: two of their forward backward; eager element-wise ops: as counted
    backward = K.BACKWARD_FACTOR * (forward - elementwise) + \
        (K.BACKWARD_FACTOR if compiled else K.EAGER_BACKWARD_FACTOR) * elementwise
    return BlockTime(forward=forward, backward=backward, attention_forward=core,
                     o_proj_forward=o_proj)


def _moe_mlp(model: LlamaConfig, layout: Layout, tokens: int, mm) -> tuple[float, float, float]:
    """(GEMM seconds, SwiGLU elements, dispatch element passes) of bunsan's MoE block on one micro-batch: the
    router over every token (whole under tensor parallelism), each of the rank's num_experts / ep experts on
    its balanced share of the routed rows (a grouped GEMM priced as that many GEMMs of its rows, at the dense
    GEMM efficiency: scripts/gpu-check's "moe block grouped_mm" row measures the kernel), the shared experts
    on every token; experts' widths split over tp. Under sequence parallelism the block routes the gathered
    sequence: `tokens` is whole."""
    moe, t, h = model.moe_config(), layout.tp, model.hidden_size
    n = routed_rows(model, tokens)
    local = moe.num_experts // layout.ep
    rows = max(1, round(n / local))
    f, fs = moe.expert_intermediate_size // t, moe.shared_width // t
    seconds = mm(tokens, h, moe.num_experts) + mm(rows, h, 2 * f, local) + mm(rows, f, h, local)
    if fs:
        seconds += mm(tokens, h, 2 * fs) + mm(tokens, fs, h)
    return seconds, n * f + tokens * fs, K.MOE_DISPATCH_PASSES * n * h


def check_kernel(attention: str, gpu: GPU) -> None:
    """cuDNN's kernel and the Triton port are priced from their published figures only (cuDNN's on Hopper, the
    port's on A100): elsewhere a clear error, not a guess."""
    if attention in OWN_CURVES and gpu.attention_fraction(attention) is None:
        raise ValueError(f"attention {attention!r} has no measured figure on {gpu.name} ({WHERE_MEASURED[attention]}"
                         "): use attention 'flash' (FlashAttention-2's figure)")


def flash_efficiency(gpu: GPU, efficiency: float, rows: int, keys: int, kernel: str = "flash") -> float:
    """The fraction of the peak a causal flash kernel runs the attention rectangle's FLOPs at (the 12·L·h·s
    convention counts the whole rectangle; the kernel computes its causal half), with `rows` queries per call.
    Where the GPU's FlashAttention-2 throughput is measured (hardware.GPU.flash_fraction: the causal half's
    FLOPs at 16k tokens), twice it (the rectangle is twice the causal half) times the kernel's curve at `rows`
    (constants.FLASH_BY_CHUNK), scaled as a fitted GEMM efficiency scales (`efficiency` / GEMM_EFFICIENCY).
    Elsewhere the GEMM efficiency at the row's own length (the causal half at half of it: the same seconds),
    times the curve's figure for `rows` over the row's (context parallelism's chunks). `kernel` "cudnn": cuDNN's
    figure and curve instead, "triton" the port's (block_time has checked that `gpu` has one)."""
    if kernel in OWN_CURVES:     # its own figure (hardware.py) and curve, --kernels or not
        return 2 * gpu.attention_fraction(kernel) * flash_at(rows, gpu, kernel) * efficiency / K.GEMM_EFFICIENCY
    if gpu.flash_fraction is None:
        return efficiency * (flash_at(rows, gpu) / flash_at(keys, gpu) if rows < keys else 1.0)
    return 2 * gpu.flash_fraction * flash_at(rows, gpu) * efficiency / K.GEMM_EFFICIENCY


def _attention_core(b: int, s: int, keys: int, heads: int, kv: int, d: int, gpu: GPU, precision: str, nb: int,
                    efficiency: float, attention: str) -> float:
    """QK^T and AV of `s` queries against `keys` keys over the full rectangle, as the 12·L·h·s convention
    counts them, at `efficiency` of the peak (flash_efficiency for a flash kernel). Flash keeps the scores on
    chip and moves only q, k, v and the output; a materialised kernel writes them and runs softmax over them."""
    if attention in FLASH_KERNELS:
        flops = 4.0 * b * heads * s * keys * d
        nbytes = (b * s * 2 * heads + b * keys * 2 * kv) * d * nb
        return max(flops / (gpu.sustained_flops(precision) * efficiency), streamed(nbytes, gpu))
    core = gemm(s, d, keys, gpu, precision, nb, efficiency, b * heads) + \
        gemm(s, keys, d, gpu, precision, nb, efficiency, b * heads)
    return core + streamed(K.SCORE_PASSES * b * heads * s * keys * nb, gpu)


def head_time(model: LlamaConfig, layout: Layout, gpu: GPU, efficiency: float) -> float:
    """Forward + backward of the LM head (and its loss) on one micro-batch: the last stage's extra work."""
    tokens, v = layout.micro_batch * layout.seq_len, -(-model.vocab_size // layout.tp)
    fwd = gemm(tokens, model.hidden_size, v, gpu, layout.precision, layout.dtype_bytes, efficiency)
    loss = streamed(3 * tokens * v * 4, gpu)     # fp32 log-softmax: read the logits, write and read back
    return (1 + K.BACKWARD_FACTOR) * (fwd + loss)


def optimizer_time(params: float, gpu: GPU) -> float:
    """The optimizer step over `params` parameters of this rank's shard: memory-bound."""
    return streamed(params * K.OPTIMIZER_BYTES_PER_PARAM, gpu)
