"""Attention over a sequence split across context-parallel ranks: all-gather of K and V.

Each rank holds the queries, keys and values of its own tokens (shard.py's balanced chunks). Every layer
all-gathers K and V over the context-parallel group, puts the gathered chunks back in global sequence order,
and attends its local queries to the whole sequence with a causal mask by global position (a query at
position i sees keys <= i). It does so chunk by chunk: each of its two chunks against the keys up to the
chunk's end only, so no rank scores keys that its queries cannot see (with one mask over the whole row every
rank would score all of it: twice the work of a causal kernel). Backward, the gradients of the gathered K and
V are reduce-scattered: each rank receives the sum, over every rank's queries, of the gradient of its own
tokens' K and V.

Why the all-gather rather than ring attention: with grouped-query attention K and V are small (the
num_key_value_heads / num_attention_heads fraction of Q), so gathering them whole costs little memory and
one collective per layer each way; it takes any mask and any attention kernel (SDPA as it is, fused kernels
included) with no online-softmax merging of partial results, and its backward is one reduce-scatter.
Llama 3 trained its 128k-token stage this way. Ring attention overlaps a ring of K/V exchanges with compute
and never holds the whole K/V, which matters only when K/V of the whole sequence do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bunsan.comm.along import all_gather_along, reduce_scatter_along
from bunsan.comm.collectives import Comm
from bunsan.comm.work import Group
from bunsan.context_parallel.shard import shard_positions
from bunsan.models.llama import Attention, LlamaConfig, apply_rope, rope_at


@dataclass
class Chunk:
    """One of the rank's two chunks: local query rows [lo, hi) see keys [0, end) of the sequence (nothing after
    the chunk's last position), through `mask` [hi - lo, end], additive: 0 where visible, -inf elsewhere."""
    lo: int
    hi: int
    end: int
    mask: torch.Tensor


@dataclass
class Layout:
    """What every layer of one forward needs, for one local length: computed once, shared by the layers."""
    positions: torch.Tensor       # [s] global positions of the local tokens
    gathered: torch.Tensor        # [S] global position of each row of the rank-order all-gather
    order: torch.Tensor           # [S] rows of the all-gather in global order (the inverse of `gathered`)
    chunks: list[Chunk]
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class CPContext:
    """The context-parallel group, its door, and the model's rotary settings."""
    comm: Comm
    group: Group
    config: LlamaConfig
    _layouts: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def layout(self, local_len: int, device: torch.device, dtype: torch.dtype) -> Layout:
        key = (local_len, str(device), dtype)
        if key not in self._layouts:
            self._layouts.clear()       # one length at a time: a training run's
            self._layouts[key] = self._make_layout(local_len, device, dtype)
        return self._layouts[key]

    def _make_layout(self, local_len: int, device: torch.device, dtype: torch.dtype) -> Layout:
        total = local_len * self.size
        if total > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {total} ({self.size} context-parallel ranks x {local_len} tokens) "
                             f"exceeds max_position_embeddings {self.config.max_position_embeddings}; shorten "
                             "the rows or raise the model's max_position_embeddings")
        positions = shard_positions(total, self.size, self.rank, device)
        gathered = torch.cat([shard_positions(total, self.size, r, device) for r in range(self.size)])
        chunk = local_len // 2          # = total / (2 cp): shard.py's chunks r and 2cp-1-r
        chunks = []
        for lo, index in ((0, self.rank), (chunk, 2 * self.size - 1 - self.rank)):
            first = index * chunk
            end = first + chunk
            # Additive and in the attention's dtype: SDPA would turn a bool mask into this in every layer and
            # keep each layer's copy for backward; made once, the layers share it.
            seen = (first + torch.arange(chunk, device=device))[:, None] >= torch.arange(end, device=device)
            mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
            chunks.append(Chunk(lo, lo + chunk, end, mask))
        cos, sin = rope_at(self.config, positions)   # in the model's dtype, as its rope tables are once cast
        return Layout(positions, gathered, torch.argsort(gathered), chunks, cos.to(dtype), sin.to(dtype))


class GatherKV(torch.autograd.Function):
    """(k, v) [b, heads, s, d] of this rank -> of the whole sequence, in global order; backward the
    reduce-scatter of their gradients. K and V travel together: one collective each way."""

    @staticmethod
    def forward(fctx, ctx: CPContext, at: Layout, k: torch.Tensor, v: torch.Tensor):
        fctx.ctx, fctx.at = ctx, at
        both = all_gather_along(ctx.comm, ctx.group, torch.stack([k, v]), dim=3)
        both = both.index_select(3, at.order)
        return both[0], both[1]

    @staticmethod
    def backward(fctx, dk, dv):
        both = torch.stack([dk, dv]).index_select(3, fctx.at.gathered)    # back to rank order
        mine = reduce_scatter_along(fctx.ctx.comm, fctx.ctx.group, both, dim=3)
        return None, None, mine[0], mine[1]


class ContextParallelAttention(Attention):
    """bunsan's Llama attention on a context-parallel shard (apply_context_parallel turns each Attention into
    one; parameters and their names are unchanged). The rope rows the caller passes are those of positions
    0..s-1, a whole short sequence's; this rank's tokens sit elsewhere, so it takes the rows of their global
    positions instead."""

    cp: CPContext

    def forward(self, x, cos, sin, kv_cache_layer=None):
        if kv_cache_layer is not None:
            raise RuntimeError("context parallelism is for training and evaluation of whole sequences; generate "
                               "with a model that is not split over context-parallel ranks")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        at = self.cp.layout(s, x.device, q.dtype)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, at.cos, at.sin), apply_rope(k, at.cos, at.sin)
        k, v = GatherKV.apply(self.cp, at, k, v)
        n_rep = q.shape[1] // k.shape[1]
        capability = (9, 0)
        if q.device.type == "cuda":
            gpu = torch.cuda.get_device_properties(q.device)
            capability = (gpu.major, gpu.minor)
        gqa = n_rep > 1 and self.native_gqa(q.device.type, q.dtype, self.head_dim, True, capability,
                                            torch.is_grad_enabled())
        if n_rep > 1 and not gqa:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        # Chunk by chunk, each against the keys up to its own end: the keys after it, all masked, are never
        # multiplied (one [s, S] mask would make every rank score the whole row, twice a causal kernel's work).
        outs = [F.scaled_dot_product_attention(q[:, :, c.lo:c.hi], k[:, :, :c.end], v[:, :, :c.end],
                                               attn_mask=c.mask, enable_gqa=gqa).transpose(1, 2)
                for c in at.chunks]
        return self.o_proj(torch.cat(outs, dim=1).reshape(b, s, -1))


def apply_context_parallel(model: torch.nn.Module, ctx: CPContext) -> int:
    """Turn every bunsan Llama Attention of `model` into a ContextParallelAttention over `ctx`; how many."""
    found = 0
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = ContextParallelAttention
            module.cp = ctx
            found += 1
    return found
