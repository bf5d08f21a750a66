"""Megatron's conjugate communication operators, as autograd functions that go through comm.py.

    f  (copy_to_tp):        forward identity         backward all-reduce     (input of a column-split block)
    g  (reduce_from_tp):    forward all-reduce       backward identity       (output of a row-split block)
    gather_seq:             forward all-gather(seq)  backward reduce-scatter (sequence parallel: into a block)
    scatter_seq:            forward reduce-scatter   backward all-gather     (sequence parallel: out of a block)

Activations are [batch, seq, hidden]; the sequence-parallel ops cut dim 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Comm, Group


@dataclass
class TPContext:
    """What every tensor-parallel layer needs: the door, the group, and whether sequence parallelism is on."""

    comm: Comm
    group: Group
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank


def _all_reduce(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous().clone()
    ctx.comm.all_reduce(x, ctx.group)
    return x


def _gather_seq(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h] (rank order along the sequence)."""
    shard = x.transpose(0, 1).contiguous()                  # [s/tp, b, h]: the gathered dim first
    out = torch.empty((shard.shape[0] * ctx.size, *shard.shape[1:]), dtype=x.dtype, device=x.device)
    ctx.comm.all_gather(out, shard, ctx.group)
    return out.transpose(0, 1)


def _scatter_seq(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """[b, s, h] summed over ranks -> this rank's [b, s/tp, h]."""
    s = x.shape[1]
    if s % ctx.size:
        raise ValueError(f"sequence length {s} is not divisible by tensor-parallel size {ctx.size}; sequence "
                         f"parallelism cuts the sequence evenly: use a multiple of {ctx.size} for data.seq_len")
    full = x.transpose(0, 1).contiguous()                   # [s, b, h]
    out = torch.empty((s // ctx.size, *full.shape[1:]), dtype=x.dtype, device=x.device)
    ctx.comm.reduce_scatter(out, full, ctx.group)
    return out.transpose(0, 1)


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        return None, _all_reduce(fctx.ctx, grad)


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x):
        return _all_reduce(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, grad


class GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        return _gather_seq(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, _scatter_seq(fctx.ctx, grad)


class ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        return _scatter_seq(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, _gather_seq(fctx.ctx, grad)


def into_parallel_region(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """Input of a block whose first matmuls are column-split: f, or the sequence all-gather under SP."""
    return GatherSeq.apply(ctx, x) if ctx.sequence_parallel else CopyToTP.apply(ctx, x)


def out_of_parallel_region(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """Output of a row-split matmul (partial sums): g, or the sequence reduce-scatter under SP."""
    return ScatterSeq.apply(ctx, x) if ctx.sequence_parallel else ReduceFromTP.apply(ctx, x)
