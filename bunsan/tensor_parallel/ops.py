"""Megatron's conjugate communication operators, as autograd functions that go through comm/collectives.py.

    f  (copy_to_tp):        forward identity         backward all-reduce     (input of a column-split block)
    g  (reduce_from_tp):    forward all-reduce       backward identity       (output of a row-split block)
    gather_seq:             forward all-gather(seq)  backward reduce-scatter (sequence parallel: into a block)
    scatter_seq:            forward reduce-scatter   backward all-gather     (sequence parallel: out of a block)

Activations are [batch, seq, hidden]; the sequence-parallel ops cut dim 1.

The backward of f (or of the SP all-gather) reduces the sum of its column-split
consumers' input gradients. Those consumers (layers.ColumnParallelLinear) hand
their input gradient to the tensor's `Region` instead of to autograd; the last
one to run starts the all-reduce (reduce-scatter) asynchronously and then
computes its weight gradient while the collective is in flight, as Megatron's
async tensor-parallel linear does. f's backward only waits. Any other consumer's
gradient still arrives through autograd and is reduced on its own.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from bunsan.comm.along import all_gather_along
from bunsan.comm.collectives import Comm, Group


@dataclass
class TPContext:
    """What every tensor-parallel layer needs: the door, the group, and whether sequence parallelism is on;
    `encoders`: a vision-language model's vision tower "split" over the ranks or kept "whole" (hf_plan.py)."""

    comm: Comm
    group: Group
    sequence_parallel: bool = False
    encoders: str = "split"

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


def _gather_dim(ctx: TPContext, x: torch.Tensor, dim: int) -> torch.Tensor:
    """The ranks' pieces of x along `dim`, in rank order."""
    return all_gather_along(ctx.comm, ctx.group, x, dim)


def _gather_seq(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h] (rank order along the sequence)."""
    return _gather_dim(ctx, x, 1)


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


class Region:
    """The column-split consumers of one parallel input, and the reduction of their summed input gradient."""

    def __init__(self, ctx: TPContext):
        self.ctx, self.consumers, self.arrived = ctx, 0, 0
        self.acc, self.handle, self.out = None, None, None
        # Sequence parallelism: the consumers save this rank's slice of their input, not the gathered whole
        # (Megatron's way), and backward gathers it once for all of their weight gradients. The slice is
        # saved by the all-gather's own autograd node (`gather`), so saved-tensor hooks see it. `gather` is a weak
        # reference: the node's saved input leads back here through C++ the garbage collector cannot see, so a
        # strong one would keep the graph, the engine and its process groups alive after the step.
        self.gather: weakref.ref | None = None
        self.full: torch.Tensor | None = None
        self.input_users = self.input_served = 0

    def full_input(self) -> torch.Tensor:
        """The gathered input, for a consumer's weight gradient: gathered at the first ask, released after the
        last."""
        if self.full is None:
            self.full = _gather_seq(self.ctx, self.gather().saved_tensors[0])
        full = self.full
        self.input_served += 1
        if self.input_served == self.input_users:
            self.full, self.input_served = None, 0
        return full

    def add(self, dx: torch.Tensor) -> None:
        """A consumer's input gradient; the last one starts the collective."""
        self.acc = dx if self.acc is None else self.acc.add_(dx)
        self.arrived += 1
        if self.arrived == self.consumers:
            self._launch()

    def _launch(self) -> None:
        ctx = self.ctx
        if ctx.sequence_parallel:
            full = self.acc.transpose(0, 1).contiguous()     # [s, b, h], as _scatter_seq (s = tp x shard)
            self.out = torch.empty((full.shape[0] // ctx.size, *full.shape[1:]), dtype=full.dtype,
                                   device=full.device)
            self.handle = ctx.comm.reduce_scatter(self.out, full, ctx.group, async_op=True)
            self.acc = full                                              # kept alive until the wait
        else:
            self.acc = self.acc.contiguous()
            self.handle = ctx.comm.all_reduce(self.acc, ctx.group, async_op=True)
            self.out = self.acc

    def finish(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The reduced input gradient: the consumers' (waited for) plus autograd's `grad` from any other."""
        if self.consumers and self.arrived < self.consumers and self.acc is not None:
            self._launch()                  # a consumer whose output got no gradient: reduce what came
        result = None
        if self.handle is not None:
            self.handle.wait()
            result = self.out.transpose(0, 1) if self.ctx.sequence_parallel else self.out
        if grad is not None:
            other = _scatter_seq(self.ctx, grad) if self.ctx.sequence_parallel else _all_reduce(self.ctx, grad)
            result = other if result is None else result + other
        return result


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x, region):
        fctx.ctx, fctx.region = ctx, region
        fctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        if fctx.region is None:
            return None, (None if grad is None else _all_reduce(fctx.ctx, grad)), None
        return None, fctx.region.finish(grad), None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x):
        if x.is_contiguous() and x._base is None:
            # A row-split matmul's (or the vocab-parallel embedding's) fresh partial sum, which no backward
            # saved: reduced in place rather than cloned (a clone copies the whole activation).
            ctx.comm.all_reduce(x, ctx.group)
            fctx.mark_dirty(x)
            return x
        return _all_reduce(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, grad


class GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x, region):
        fctx.ctx, fctx.region = ctx, region
        fctx.set_materialize_grads(False)
        if region is not None:
            fctx.save_for_backward(x)
            region.gather = weakref.ref(fctx)
        return _gather_seq(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        if fctx.region is None:
            return None, (None if grad is None else _scatter_seq(fctx.ctx, grad)), None
        return None, fctx.region.finish(grad), None


class ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        return _scatter_seq(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, _gather_seq(fctx.ctx, grad)


def into_parallel_region(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """Input of a block whose first matmuls are column-split: f, or the sequence all-gather under SP. With
    autograd on, the result carries the Region its column-split consumers reduce through."""
    region = Region(ctx) if torch.is_grad_enabled() and x.requires_grad else None
    y = GatherSeq.apply(ctx, x, region) if ctx.sequence_parallel else CopyToTP.apply(ctx, x, region)
    if region is not None:
        y._bunsan_region = region
    return y


def region_of(x: torch.Tensor) -> Region | None:
    return getattr(x, "_bunsan_region", None)


class RegionLinear(torch.autograd.Function):
    """y = x W^T for a column-split consumer of a parallel input: the input gradient goes to the Region (whose
    last consumer starts the collective), then the weight gradient is computed while it runs."""

    @staticmethod
    def forward(fctx, x, weight, region):
        fctx.by_shard = region.gather is not None
        if fctx.by_shard:       # the all-gather keeps the slice; x (the gathered whole) is not kept
            region.input_users += 1
            fctx.save_for_backward(weight)
        else:
            fctx.save_for_backward(x, weight)
        fctx.region = region
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(fctx, gy):
        saved = fctx.saved_tensors      # (unpacked once: checkpointing allows no second unpack)
        weight = saved[-1]
        fctx.region.add(gy.matmul(weight))
        x = fctx.region.full_input() if fctx.by_shard else saved[0]
        gw = None
        if fctx.needs_input_grad[1]:
            gw = gy.reshape(-1, gy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return None, gw, None


class SplitSeq(torch.autograd.Function):
    """A [b, s, h] every rank holds whole -> this rank's [b, s/tp, h]: a slice forward, the slices' gradients
    all-gathered backward (where a model's sequence-parallel region starts after a whole-sequence part)."""

    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        s = x.shape[1]
        if s % ctx.size:
            raise ValueError(f"sequence length {s} is not divisible by tensor-parallel size {ctx.size}; sequence "
                             f"parallelism cuts the sequence evenly: use a multiple of {ctx.size}")
        n = s // ctx.size
        return x[:, ctx.rank * n:(ctx.rank + 1) * n].contiguous()

    @staticmethod
    def backward(fctx, grad):
        return None, _gather_seq(fctx.ctx, grad.contiguous())


def _gather_last(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """[..., n/tp] -> [..., n] (rank order along the last dimension)."""
    return _gather_dim(ctx, x, -1)


def _local_last(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // ctx.size
    return x[..., ctx.rank * n:(ctx.rank + 1) * n].contiguous()


class GatherLast(torch.autograd.Function):
    """A column layer's output slices made whole on every rank (forward all-gather, backward this rank's
    slice of the gradient: every rank computes the same whole-output gradient)."""

    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        return _gather_last(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, _local_last(fctx.ctx, grad)


class SplitLast(torch.autograd.Function):
    """A whole input cut to this rank's columns for a row layer (forward a slice, backward the slices'
    gradients all-gathered)."""

    @staticmethod
    def forward(fctx, ctx, x):
        fctx.ctx = ctx
        if x.shape[-1] % ctx.size:
            raise ValueError(f"a row layer's input of {x.shape[-1]} features does not split over {ctx.size} ranks")
        return _local_last(ctx, x)

    @staticmethod
    def backward(fctx, grad):
        return None, _gather_last(fctx.ctx, grad)


def sum_over_tp(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """g (forward all-reduce, backward identity) whatever sequence parallelism says: an output every rank
    needs whole."""
    return ReduceFromTP.apply(ctx, x)


def out_of_parallel_region(ctx: TPContext, x: torch.Tensor) -> torch.Tensor:
    """Output of a row-split matmul (partial sums): g, or the sequence reduce-scatter under SP. x is consumed:
    without SP it is reduced in place when it is a contiguous tensor of its own."""
    return ScatterSeq.apply(ctx, x) if ctx.sequence_parallel else ReduceFromTP.apply(ctx, x)
