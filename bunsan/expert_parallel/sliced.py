"""Expert x tensor parallelism's dispatch: each tensor-parallel rank sends its 1/tp slice of the routed rows.

Under tensor parallelism every rank of a tensor-parallel group routes the same rows (the block's input is whole
there) and holds a width share of the same experts. Sending every row from every one of them would cross the
expert-parallel group tp times (the network, across nodes); instead, as Megatron-Core's dispatcher does:

    slice      each tensor-parallel rank takes its chunk of every expert's run of rows (sorted by expert)
    dispatch   the chunk goes by all-to-all to the ranks of its experts, over the expert-parallel group
    gather     the tensor-parallel group gathers what its ranks received (inside a node): every rank there
               computes its width share of each expert on all of those rows
    scatter    the partial outputs are summed and scattered back over the tensor-parallel group: each rank gets
               the whole outputs of the rows it received
    return     by all-to-all to the rows' ranks, placed at the chunk's rows and zero elsewhere

The last is the block's contract under tensor parallelism (tensor_parallel/moe.py): each rank's output is a part
whose sum over the group is the whole, summed once after the block. The all-to-alls carry 1/tp of the rows;
the gather and scatter are the tensor-parallel group's own collectives, padded to the longest rank's rows.
"""
from __future__ import annotations

import torch

from bunsan.comm.collectives import Comm, Group

__all__ = ["chunk_of_runs", "gather_rows", "scatter_rows"]


def chunk_of_runs(counts: torch.Tensor, parts: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, counts per run) of chunk `part` of `parts` of each run of `counts` rows (runs laid out one after
    another): near-equal chunks, the first count % parts of them one row longer."""
    starts = counts.cumsum(0) - counts
    share, extra = counts // parts, counts % parts
    mine = share + (part < extra).long()
    first = starts + part * share + torch.clamp(extra, max=part)
    total = int(mine.sum())                 # host: the chunk's size sizes the index
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(mine.cumsum(0) - mine, mine,
                                                                                   output_size=total)
    return torch.repeat_interleave(first, mine, output_size=total) + within, mine


def _padded(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """[len(parts) * rows, ...]: each part padded with zero rows to `rows`."""
    out = parts[0].new_zeros((len(parts) * rows, *parts[0].shape[1:]))
    for i, p in enumerate(parts):
        out[i * rows:i * rows + p.shape[0]] = p
    return out


def _gather(x: torch.Tensor, sizes: list[int], comm: Comm, group: Group) -> torch.Tensor:
    rows = max(max(sizes), 1)       # (a group none of whose ranks received a row still gathers, and waits for no one)
    full = x.new_empty((len(sizes) * rows, *x.shape[1:]))
    comm.all_gather(full, _padded([x], rows), group)
    return torch.cat([full[i * rows:i * rows + n] for i, n in enumerate(sizes)])


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], comm: Comm, group: Group):
        ctx.sizes, ctx.comm, ctx.group = sizes, comm, group
        return _gather(x, sizes, comm, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter(grad, ctx.sizes, ctx.comm, ctx.group), None, None, None


def _scatter(x: torch.Tensor, sizes: list[int], comm: Comm, group: Group) -> torch.Tensor:
    rows = max(max(sizes), 1)
    out = x.new_empty((rows, *x.shape[1:]))
    comm.reduce_scatter(out, _padded(list(x.split(sizes)), rows), group)
    return out[:sizes[group.rank]]


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], comm: Comm, group: Group):
        ctx.sizes, ctx.comm, ctx.group = sizes, comm, group
        return _scatter(x.contiguous(), sizes, comm, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad.contiguous(), ctx.sizes, ctx.comm, ctx.group), None, None, None


def gather_rows(x: torch.Tensor, sizes: list[int], comm: Comm, group: Group) -> torch.Tensor:
    """Every rank's rows of `group` (`sizes[r]` from rank r), in rank order; backward: the gradients summed and
    scattered back."""
    return _GatherRows.apply(x.contiguous(), sizes, comm, group)


def scatter_rows(x: torch.Tensor, sizes: list[int], comm: Comm, group: Group) -> torch.Tensor:
    """x [sum(sizes), ...] summed over `group`, and this rank's `sizes[rank]` rows of the sum; backward: gathered."""
    return _ScatterRows.apply(x, sizes, comm, group)
