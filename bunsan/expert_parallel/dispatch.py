"""Expert parallelism inside one MoE block: this rank's share of the experts, and the all-to-all that brings
them the tokens routed to them from every rank of the expert-parallel group and sends the outputs back.

The block (models/moe.py) sorts its assignments by expert and counts them per expert; with the experts split
evenly and contiguously over the group (rank r holds experts r * E/ep ... (r + 1) * E/ep - 1), those counts
already are the per-rank send sizes. A forward through `ShardedExperts`:

    counts [E] -> [ep, E/ep]      all-to-all (fixed size): what every rank sends to each of my experts
    tokens                         all-to-all (uneven): rows arrive by source rank, then by expert
    regroup                        rows by my expert, then by source: what the grouped GEMM takes
    experts                        GroupedExperts' kernel on my E/ep experts
    ungroup, all-to-all back       the outputs return to the rank and place each token came from

Under tensor parallelism too each tensor-parallel rank dispatches only its slice of the rows (sliced.py).

Dropless by default: every routed assignment is computed, whatever the imbalance; a capacity factor caps what
the block keeps before any of this. A rank (or an expert) that receives no rows still takes part in every
all-to-all, forward and backward, so no rank waits on another. The uneven splits are read on the host once
per block forward (the collective needs them as sizes); the backward reuses them.
"""
from __future__ import annotations

import torch
from torch import nn

from bunsan.comm.collectives import Comm, Group
from bunsan.expert_parallel.sliced import chunk_of_runs, gather_rows, scatter_rows
from bunsan.models.moe_experts import GroupedExperts


class AllToAllV(torch.autograd.Function):
    """Rows of `x` split by `in_splits` to the group's ranks, `out_splits` rows back from each; the gradient
    goes back the same way with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm, group: Group):
        ctx.splits, ctx.comm, ctx.group = (out_splits, in_splits), comm, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_v(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all_v(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None, None


def regroup_index(recv_counts: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows] int64: for the received rows (by source rank, then local expert; recv_counts [ep, E_local]) the
    order that puts them by local expert, then source rank: grouped[i] = received[index[i]]."""
    ep, local = recv_counts.shape
    lengths_src_major = recv_counts.reshape(-1)
    starts_src_major = (lengths_src_major.cumsum(0) - lengths_src_major).view(ep, local)
    lengths = recv_counts.t().reshape(-1)             # expert-major: (expert 0, src 0), (expert 0, src 1), ...
    starts = starts_src_major.t().reshape(-1)
    new_starts = lengths.cumsum(0) - lengths
    offset = torch.arange(rows, device=recv_counts.device)
    return (offset - torch.repeat_interleave(new_starts, lengths, output_size=rows)
            + torch.repeat_interleave(starts, lengths, output_size=rows))


class ShardedExperts(GroupedExperts):
    """E / ep of a block's experts (w1, w3, w2 sliced along dim 0; the same parameter names), computing the
    tokens every rank of `group` routes to them. `ep_split` records each weight's full shape for the
    checkpoints and the consolidated state dict (gathered along dim 0 over the group)."""

    def __init__(self, full: GroupedExperts, comm: Comm, group: Group, tp_group: Group | None = None):
        nn.Module.__init__(self)
        ep = group.size
        if full.num_experts % ep:
            raise ValueError(f"a MoE block of {full.num_experts} experts cannot be split evenly over "
                             f"{ep} expert-parallel ranks; set expert_parallel.autoep_size to a divisor of "
                             f"{full.num_experts}")
        local = full.num_experts // ep
        self.num_experts, self.dim, self.hidden, self.kernel = local, full.dim, full.hidden, full.kernel
        self.total_experts, self.comm, self.group = full.num_experts, comm, group
        # each expert's width also cut over a tensor-parallel group: dispatch each rank's slice of the rows (sliced.py)
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.first = group.rank * local
        self.tp_split = dict(getattr(full, "tp_split", {}))    # each expert's width cut by tensor parallelism
        self.ep_split = {}
        for name in ("w1", "w3", "w2"):
            w = getattr(full, name)
            self.ep_split[name] = tuple(w.shape)
            mine = w.detach()[self.first:self.first + local]
            setattr(self, name, nn.Parameter(mine if mine.is_meta else mine.clone(), requires_grad=w.requires_grad))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim]: this rank's assignments sorted by (global) expert, counts [E] per expert -> [N, dim]."""
        if counts.shape != (self.total_experts,):
            raise ValueError(f"counts must have one entry per expert ({self.total_experts},), got "
                             f"{tuple(counts.shape)}")
        if self.tp_group is not None:
            return self._sliced(x, counts)
        ep, local = self.group.size, self.num_experts
        send_counts = counts.view(ep, local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        self.comm.all_to_all(recv_counts, send_counts, self.group)      # row r: what rank r sends my experts
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()   # host: the collective's sizes
        send, recv = sizes[:ep], sizes[ep:]
        received = AllToAllV.apply(x, recv, send, self.comm, self.group)
        rows = sum(recv)
        index = regroup_index(recv_counts, rows)
        y = super().forward(received.index_select(0, index), recv_counts.sum(0))
        back = torch.empty_like(index).scatter_(0, index, torch.arange(rows, device=index.device))
        return AllToAllV.apply(y.index_select(0, back), send, recv, self.comm, self.group)

    def _sliced(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """forward's expert x tensor parallelism: this tensor-parallel rank's slice of the rows dispatched, the
        group's received rows computed together (sliced.py); the whole outputs at the slice's rows, zero at the
        rest (the block sums its output over the tensor-parallel group)."""
        ep, local, tp = self.group.size, self.num_experts, self.tp_group
        rows_index, mine = chunk_of_runs(counts, tp.size, tp.rank)
        send_counts = mine.view(ep, local).contiguous()
        recv_counts = torch.empty_like(send_counts)
        self.comm.all_to_all(recv_counts, send_counts, self.group)
        group_counts = torch.empty((tp.size * ep, local), dtype=recv_counts.dtype, device=recv_counts.device)
        self.comm.all_gather(group_counts, recv_counts, tp)            # what every tp rank received, by source
        counted = torch.cat([send_counts.sum(1), recv_counts.sum(1), group_counts.view(tp.size, -1).sum(1)])
        sizes = counted.tolist()        # host: the collectives' sizes
        send, recv, gathered = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
        received = AllToAllV.apply(x.index_select(0, rows_index), recv, send, self.comm, self.group)
        together = gather_rows(received, gathered, self.comm, tp)
        index = regroup_index(group_counts, together.shape[0])
        y = super().forward(together.index_select(0, index), group_counts.sum(0))
        back = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel(), device=index.device))
        whole = scatter_rows(y.index_select(0, back), gathered, self.comm, tp)    # my received rows, summed
        returned = AllToAllV.apply(whole, send, recv, self.comm, self.group)
        return x.new_zeros((x.shape[0], returned.shape[1])).index_copy(0, rows_index, returned)

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.num_experts - 1} of {self.total_experts} over "
                f"{self.group.size} ranks")
