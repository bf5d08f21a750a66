"""Activation memory of bunsan's Llama: what autograd saves, tensor by tensor, per micro-batch.

The counts come from the model's own ops (read off with saved_tensors_hooks, and
checked against them in tests/test_estimator.py), for b samples of s tokens, hidden h,
intermediate i, a query heads and kv key/value heads of head_dim e, model dtype of d bytes,
tensor-parallel size t:

  each RMSNorm        its input d·bsh and the fp32 per-token rstd 4·bs (models/saving.py); on s/t
                      tokens under sequence parallelism
  block matmul inputs the normed input of q/k/v and of gate/up: 2·d·bsh; under sequence parallelism
                      the slice before the all-gather, 2·d·bsh/t (gathered again in backward, as Megatron)
  attention           q and the output: 2·d·bsh/t (the output feeds o_proj as a view); k and v:
                      2·d·bs·w/t, w = kv·e where SDPA takes them with their own heads (enable_gqa:
                      CUDA in 16-bit, CPU; Attention.native_gqa), else w = h, repeated to every query
                      head (CUDA fp32, whose memory-efficient kernel needs equal head counts); and the
                      fp32 log-sum-exp 4·b·(a/t)·s
  MLP                 gate and up (the SwiGLU saves only them) and their product, down_proj's input:
                      3·d·bsi/t

A transformers block with q/k norms (Qwen3) keeps their inputs and fp32 rstds besides: b·s·(a + kv)·(d·e + 4)/t.

so a block keeps (4d·bsh + 8bs)/σ + 2d·bsh/t + 2d·bsw/t + 3d·bsi/t + 4bas/t bytes (σ = t under SP, else
1): with w = kv·e, 12h + 4h_kv + 6i bytes per token in 16-bit (every term over t under SP) plus the fp32
statistics, the bound of issue #24 (tests/test_activation_bound.py), where Korthikanti et al. (2022) count
s·b·h·(34 + 5as/h) for GPT blocks without flash attention. With activation checkpointing a block keeps only
its input, d·bsh/σ, and one block's full set lives again while it is recomputed in backward.

Under context parallelism (cp ranks) s is the rank's share of a row, and the K/V SDPA saves are the
all-gathered ones of the whole row: 2d·b·(cp·s)·w/t; attention runs chunk by chunk (context_parallel/
attention.py), and the chunks' outputs joined for o_proj are one more copy of the output, d·bsh/t. The causal
masks by global position (two chunks of s/2 queries, each against the keys up to its end) are shared by every
block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bunsan.models.llama import Attention, LlamaConfig


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank."""
    b: int              # samples
    s: int              # tokens per sample
    d: int              # model dtype bytes
    tp: int = 1
    sp: bool = False
    device: str = "cuda"   # device type: which attention kernels run, so whether K/V are saved repeated
    cp: int = 1         # context parallel: s is this rank's share of a row, attention's K/V are cp x s long
    # a transformers block given a padding attention_mask: it repeats K/V to every head (SDPA's GQA only without
    # a mask), and each layer's SDPA turns the boolean [b, 1, s, s] mask into one of the model dtype, kept
    padding_mask: bool = False
    # a transformers block with an RMSNorm on each head of q and of k (Qwen3's q_norm, k_norm): in the saving
    # forms each keeps its input (q_proj's, k_proj's output) and an fp32 rstd per token and head
    qk_norm: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.d >= 4 else torch.bfloat16   # fp16 takes the same kernels as bf16

    @property
    def seq_div(self) -> int:
        return self.tp if self.sp else 1


def norm_bytes(c: LlamaConfig, m: Micro) -> float:
    return (m.d * m.b * m.s * c.hidden_size + 4 * m.b * m.s) / m.seq_div


def block_bytes(c: LlamaConfig, m: Micro) -> float:
    """Saved bytes of one transformer block, one micro-batch, no recomputation."""
    b, s, h, t, d = m.b, m.s, c.hidden_size, m.tp, m.d
    heads = c.num_attention_heads // t
    grouped = Attention.native_gqa(m.device, m.dtype, c.head_dim, masked=m.cp > 1) and not m.padding_mask
    kv_heads = c.num_key_value_heads // t if grouped else heads
    attention = 2 * d * b * s * (heads + kv_heads * m.cp) * c.head_dim + 4 * b * heads * s
    if m.padding_mask:
        attention += d * b * s * s
    if m.cp > 1:    # the two chunks' outputs joined for o_proj: a copy beside the ones SDPA keeps
        attention += d * b * s * heads * c.head_dim
    if m.qk_norm:
        attention += b * s * (heads + c.num_key_value_heads // t) * (d * c.head_dim + 4)
    if c.moe is not None:       # the MoE block keeps its own input (the router's) and the routed tokens' tensors
        return 2 * norm_bytes(c, m) + d * b * s * h / m.seq_div + attention + moe_bytes(c, m)
    mlp = 3 * d * b * s * (c.intermediate_size // t)
    return 2 * norm_bytes(c, m) + 2 * d * b * s * h / m.seq_div + attention + mlp


def routed_rows(c: LlamaConfig, tokens: int) -> int:
    """(token, expert) assignments one MoE block computes for `tokens` tokens: tokens x top_k dropless, at most
    each expert's capacity under a capacity factor (the bound: which assignments are dropped depends on the
    data). Under expert parallelism a rank computes about as many, its experts' share of every rank's tokens,
    with balanced routing."""
    moe = c.moe_config()
    cap = moe.capacity(tokens)
    return tokens * moe.top_k if cap is None else min(tokens * moe.top_k, moe.num_experts * cap)


def moe_bytes(c: LlamaConfig, m: Micro) -> float:
    """Saved bytes of bunsan's MoE block (models/moe.py) for one micro-batch, its input included. T = b·s tokens
    (whole under SP: the block's input is gathered), n routed assignments, E experts, f each expert's width
    and f_s the shared experts' (both over t: tensor parallelism splits every expert's width):

      input       the router's fp32 input 4·Th (in an fp32 run without SP: the normed input itself, d·Th),
                  and the shared experts' 16-bit input d·Th besides, in 16-bit (E·h·4: the router weight's copy)
      routing     the scores' softmax or sigmoid 4·TE, the top-k's indices and weights 12·Tk, the
                  renormalisation's sums 4·T, the dispatch's two indices 16·n; z-loss's logits and
                  log-sum-exps 4·TE + 8·T
      experts     the tokens gathered by expert, gate and up (saved by the SwiGLU) and their product
                  (the down projection's input), the outputs, and the outputs weighted (kept by the
                  scatter back): n·(3hd + 3fd/t + d)
      shared      gate, up and their product: 3d·T·f_s/t
    """
    moe = c.moe_config()
    d, t, h, e, k = m.d, m.tp, c.hidden_size, moe.num_experts, moe.top_k
    tokens = m.b * m.s
    n = routed_rows(c, tokens)
    if d >= 4 and not m.sp:
        inputs = d * tokens * h
    else:
        inputs = 4 * tokens * h + (d * tokens * h if moe.shared_width else 0) + (4 * e * h if d < 4 else 0)
    routing = 4 * tokens * e + 12 * tokens * k + (4 * tokens if moe.normalizes_routes else 0) + 16 * n \
        + (4 * tokens * e + 8 * tokens if moe.z_loss_coef else 0) + (4 * e if moe.aux_loss_coef else 0)
    experts = n * (3 * h * d + 3 * d * moe.expert_intermediate_size // t + d)
    shared = 3 * d * tokens * moe.shared_width // t
    return inputs + routing + experts + shared


def block_input_bytes(c: LlamaConfig, m: Micro) -> float:
    """What a checkpointed block keeps: its input (the residual stream, sequence-sharded under SP)."""
    return m.d * m.b * m.s * c.hidden_size / m.seq_div


def head_bytes(c: LlamaConfig, m: Micro) -> float:
    """Final norm and the LM head's input, saved until backward (the logits are priced by loss_bytes)."""
    return norm_bytes(c, m) + m.d * m.b * m.s * c.hidden_size


def embedding_bytes(c: LlamaConfig, m: Micro) -> float:
    return 8 * m.b * m.s   # the int64 token ids the embedding's backward indexes with


def loss_bytes(c: LlamaConfig, m: Micro) -> tuple[float, float]:
    """(kept, transient) bytes of the logits and the cross-entropy over bsV/t logits.

    Both losses walk the logits a chunk of rows at a time (default_chunk_rows of the rank's width), so
    their fp32 work lives one chunk at a time, and keep until backward the logits themselves (d bytes
    each); the int64 labels are the token ids the embedding keeps already. When backward starts the
    logits' gradient (d bytes each) appears, whole. Per loss:

      bunsan.lm_loss (t = 1)              forward: the chunk's upcast and log-softmax (one buffer in fp32);
                                          backward: the same two in 16-bit, none in fp32 (the gradient's
                                          own rows are the work)
      tensor_parallel/loss.py (t > 1)     kept besides: the fp32 max and sum of exp of each row (8·bs);
                                          forward: one buffer (logit - max, exponentiated in place);
                                          backward: that one in 16-bit, none in fp32
    """
    from bunsan.models.loss import default_chunk_rows
    v = -(-c.vocab_size // m.tp)
    n = m.b * m.s * v
    chunk = min(m.b * m.s, default_chunk_rows(v)) * v
    if m.tp == 1:
        backward = m.d * n + (8 * chunk if m.d < 4 else 0)
        forward = 8 * chunk if m.d < 4 else 4 * chunk
        return m.d * n, max(backward, forward)
    backward = m.d * n + (4 * chunk if m.d < 4 else 0)
    return m.d * n + 8 * m.b * m.s, max(backward, 4 * chunk)


def stage_activation_bytes(c: LlamaConfig, m: Micro, blocks: int, first: bool, last: bool,
                           checkpointing: bool, in_flight: int = 1) -> dict:
    """Activation bytes of one pipeline rank holding `blocks` blocks with `in_flight` micro-batches alive.

    Returns kept (held from forward to backward, all micro-batches in flight), recompute (one
    block's full set during its recomputation) and loss_transient (logits gradients at the start
    of backward, on the last stage).
    """
    per_block = block_input_bytes(c, m) if checkpointing else block_bytes(c, m)
    kept = blocks * per_block
    if first:
        kept += embedding_bytes(c, m)
    loss_kept, loss_transient = loss_bytes(c, m) if last else (0.0, 0.0)
    if last:
        kept += head_bytes(c, m) + loss_kept
    return {"kept": kept * in_flight,
            "recompute": block_bytes(c, m) if checkpointing and blocks else 0.0,
            "loss_transient": loss_transient}


def korthikanti_bytes(c: LlamaConfig, m: Micro) -> float:
    """Korthikanti et al. 2022, eq. for one GPT block in 16-bit without recomputation: sbh(34 + 5as/h)."""
    b, s, h, a = m.b, m.s, c.hidden_size, c.num_attention_heads
    if m.sp:
        return s * b * h / m.tp * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / m.tp + 5 * a * s / (h * m.tp))
