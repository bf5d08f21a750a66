"""Tensor-parallel layers that replace a plain model's nn.Linear / nn.Embedding in place.

Column split (q/k/v, gate/up, LM head): each rank holds a block of output rows.

    W [out, in]  ->  rank r: W[r*out/tp:(r+1)*out/tp, :]     y_r = x W_r^T   (a slice of y, no communication)

Row split (o_proj, down_proj): each rank holds a block of input columns and the
matching slice of the activations; the partial products are summed (g, or the
sequence reduce-scatter under sequence parallelism).

    W [out, in]  ->  rank r: W[:, r*in/tp:(r+1)*in/tp]       y = sum_r x_r W_r^T

Vocabulary-parallel embedding: rank r holds rows [r*V/tp, (r+1)*V/tp) of the
table (padded to a multiple of tp); tokens outside its range look up zeros and the
ranks' results are summed.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bunsan.tensor_parallel.ops import (RegionLinear, TPContext, into_parallel_region, out_of_parallel_region, region_of)


def split_rows(w: torch.Tensor, tp: int, rank: int, pad_to: int | None = None) -> torch.Tensor:
    rows = w.shape[0] if pad_to is None else pad_to
    if pad_to is not None and pad_to > w.shape[0]:
        w = torch.cat([w, w.new_zeros(pad_to - w.shape[0], *w.shape[1:])])
    n = rows // tp
    return w[rank * n:(rank + 1) * n].clone()


def region_linear(x: torch.Tensor, weight: nn.Parameter) -> torch.Tensor:
    """x W^T; a trained weight on a parallel input reduces its input gradient through the region, overlapped
    with its weight gradient (ops.py)."""
    region = region_of(x)
    if region is not None and weight.requires_grad:
        region.consumers += 1
        return RegionLinear.apply(x, weight, region)
    return F.linear(x, weight)


class ColumnParallelLinear(nn.Module):
    """A block of output rows; its input must already be in the parallel region (see ParallelInput)."""

    def __init__(self, linear: nn.Linear, ctx: TPContext):
        super().__init__()
        self.tp_style, self.tp_dim, self.full_shape = "column", 0, tuple(linear.weight.shape)
        w = linear.weight.detach()
        self.weight = nn.Parameter(split_rows(w, ctx.size, ctx.rank), requires_grad=linear.weight.requires_grad)

    def forward(self, x):
        return region_linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """A block of input columns; the partial outputs are summed over the tensor-parallel group."""

    def __init__(self, linear: nn.Linear, ctx: TPContext):
        super().__init__()
        self.ctx, self.tp_style, self.tp_dim, self.full_shape = ctx, "row", 1, tuple(linear.weight.shape)
        w = linear.weight.detach()
        self.weight = nn.Parameter(split_rows(w.t(), ctx.size, ctx.rank).t().contiguous(),
                                   requires_grad=linear.weight.requires_grad)

    def forward(self, x):
        return out_of_parallel_region(self.ctx, F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, emb: nn.Embedding, ctx: TPContext):
        super().__init__()
        self.ctx, self.tp_style, self.tp_dim = ctx, "vocab", 0
        self.vocab_size = emb.num_embeddings
        self.padded = -(-self.vocab_size // ctx.size) * ctx.size
        self.full_shape = (self.vocab_size, emb.embedding_dim)
        self.per_rank = self.padded // ctx.size
        self.start = ctx.rank * self.per_rank
        self.weight = nn.Parameter(split_rows(emb.weight.detach(), ctx.size, ctx.rank, self.padded),
                                   requires_grad=emb.weight.requires_grad)

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return out_of_parallel_region(self.ctx, out)


class VocabParallelHead(nn.Module):
    """LM head split over the vocabulary: each rank computes its [b, s, V/tp] slice of the logits.

    The loss (loss.py) works on the slices; `gather_output` (generation) all-gathers them.
    """

    def __init__(self, head: nn.Linear, ctx: TPContext, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.ctx, self.tp_style, self.tp_dim = ctx, "vocab", 0
        self.vocab_size = head.out_features
        self.padded = -(-self.vocab_size // ctx.size) * ctx.size
        self.full_shape = (self.vocab_size, head.in_features)
        self.start = ctx.rank * (self.padded // ctx.size)
        self.gather_output = False
        if tied is not None:
            self.weight = tied.weight       # the same Parameter: tied stays tied
        else:
            self.weight = nn.Parameter(split_rows(head.weight.detach(), ctx.size, ctx.rank, self.padded),
                                       requires_grad=head.weight.requires_grad)

    def forward(self, x):
        logits = region_linear(into_parallel_region(self.ctx, x), self.weight)
        if not self.gather_output:
            return logits
        shard = logits.movedim(-1, 0).contiguous()
        full = torch.empty((shard.shape[0] * self.ctx.size, *shard.shape[1:]), dtype=shard.dtype,
                           device=shard.device)
        self.ctx.comm.all_gather(full, shard, self.ctx.group)
        return full[:self.vocab_size].movedim(0, -1)


def parallel_input_hook(ctx: TPContext):
    """A block's input enters the parallel region once (f, or the SP all-gather), shared by all its matmuls."""
    def hook(module, args, kwargs):
        return (into_parallel_region(ctx, args[0]), *args[1:]), kwargs
    return hook


def sum_grad_over_tp(param: nn.Parameter, ctx: TPContext) -> None:
    """A replicated weight that each rank sees only part of the data for (SP norms): sum its gradient."""
    if not param.requires_grad:      # frozen (a LoRA base): no gradient to sum
        return

    def hook(grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.group)
        return grad
    param.register_hook(hook)
