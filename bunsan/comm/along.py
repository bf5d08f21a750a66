"""All-gather and reduce-scatter of a tensor along any dimension, over a group: the collectives move the
dimension first (contiguous pieces, in rank order) and the result moves it back. Tensor and sequence
parallelism (tensor_parallel/ops.py) and context parallelism (context_parallel/) cut activations this way."""

from __future__ import annotations

import torch

from bunsan.comm.collectives import Comm
from bunsan.comm.work import Group


def all_gather_along(comm: Comm, group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
    """The ranks' pieces of x concatenated along `dim`, in rank order."""
    shard = x.movedim(dim, 0).contiguous()
    out = torch.empty((shard.shape[0] * group.size, *shard.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, shard, group)
    return out.movedim(0, dim)


def reduce_scatter_along(comm: Comm, group: Group, x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over the ranks, and this rank's piece of the sum along `dim` (pieces in rank order)."""
    n = x.shape[dim]
    if n % group.size:
        raise ValueError(f"reduce-scatter along dim {dim} of length {n} over the {group.size} ranks of group "
                         f"'{group.name}': the length must be a multiple of {group.size}")
    full = x.movedim(dim, 0).contiguous()
    out = torch.empty((n // group.size, *full.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, full, group)
    return out.movedim(0, dim)
