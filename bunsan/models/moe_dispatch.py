"""Moving tokens to their experts and back: the MoE block's dispatch and combine (models/moe.py).

dispatch() turns each token's k chosen experts into one list of assignments sorted by expert, with the count
per expert, which is exactly what a grouped GEMM takes (group sizes) and what expert parallelism will send
through an all-to-all (experts are contiguous per rank, so the counts split into per-rank send sizes). It also
applies the capacity: an expert over its capacity keeps the first `capacity` of its assignments in the
policy's order and drops the rest.

combine() puts the experts' outputs back in token order, weighted, and sums each token's k. It writes every
assignment into its own (token, slot) row and sums the k rows, rather than adding into the token rows in
place: the sum has one fixed order (index_add's atomics on a GPU do not), and a dropped assignment is a row of
zeros, so its token keeps only what the residual and the shared experts give it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bunsan.models.moe_config import DROP_POLICIES


@dataclass
class Dispatch:
    """The assignments of T tokens x k slots kept for computing, grouped by expert (expert 0's first)."""

    order: torch.Tensor         # [N] int64: each kept assignment's flat index t * k + slot
    token_index: torch.Tensor   # [N] int64: the token each kept assignment came from (order // k)
    weights: torch.Tensor       # [N] combine weights in the same order (carry the router's gradient)
    counts: torch.Tensor        # [E] int64: kept assignments per expert (the grouped GEMM's group sizes)
    routed: torch.Tensor        # [E] int64: assignments the router chose per expert, before capacity
    kept: torch.Tensor          # [T, k] bool: which assignments were kept
    top_k: int

    @property
    def dropped(self) -> torch.Tensor:
        """[E] int64: assignments dropped per expert for capacity."""
        return self.routed - self.counts

    @property
    def num_tokens(self) -> int:
        return self.kept.shape[0]


def dispatch(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None = None,
             drop_policy: str = "probs") -> Dispatch:
    """Sort the assignments `experts` [T, k] (weighted by `weights` [T, k]) by expert.

    capacity None: dropless, every assignment kept. Else each expert keeps at most `capacity` assignments:
    under "probs" those with the highest weight, under "position" those of the earliest tokens (slot order
    within a token); ties in weight go to the earlier token. Within an expert the assignments stay in the
    policy's order (for computing it does not matter).
    """
    if experts.dim() != 2 or weights.shape != experts.shape:
        raise ValueError(f"dispatch takes experts and weights of one shape [tokens, top_k], got "
                         f"{tuple(experts.shape)} and {tuple(weights.shape)}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy {drop_policy!r} is not one of {DROP_POLICIES}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise ValueError(f"capacity must be None (dropless) or an int >= 0, got {capacity!r}")
    t, k = experts.shape
    flat = experts.reshape(-1)
    routed = torch.bincount(flat, minlength=num_experts)
    if capacity is None or drop_policy == "position":
        order = torch.argsort(flat, stable=True)            # by expert, then token, then slot
    else:
        by_weight = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
        order = by_weight[torch.argsort(flat[by_weight], stable=True)]     # by expert, then weight descending
    if capacity is None:
        kept = torch.ones(t, k, dtype=torch.bool, device=experts.device)
        counts = routed
    else:
        starts = routed.cumsum(0) - routed                   # where each expert's run begins in `order`
        rank = torch.arange(order.numel(), device=experts.device) - starts[flat[order]]
        keep_sorted = rank < capacity
        kept = torch.zeros(t * k, dtype=torch.bool, device=experts.device).scatter(0, order, keep_sorted).view(t, k)
        order = order[keep_sorted]   # host: the kept count sizes the tensor (dropless forwards never sync here)
        counts = routed.clamp(max=capacity)
    return Dispatch(order=order, token_index=order // k, weights=weights.reshape(-1)[order], counts=counts,
                    routed=routed, kept=kept, top_k=k)


def combine(expert_out: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """[T, dim]: each token's sum over its kept slots of weight * expert output (see the module docstring).

    expert_out [N, dim] is in the dispatch's order. The weights are cast to its dtype (fp32 routing, 16-bit
    experts), as the experts' outputs are what the model carries on."""
    if expert_out.dim() != 2 or expert_out.shape[0] != d.order.numel():
        raise ValueError(f"expert outputs must be [{d.order.numel()} kept assignments, dim], got shape "
                         f"{tuple(expert_out.shape)}")
    weighted = expert_out * d.weights.to(expert_out.dtype).unsqueeze(-1)
    rows = expert_out.new_zeros(d.num_tokens * d.top_k, expert_out.shape[1]).index_copy(0, d.order, weighted)
    return rows.view(d.num_tokens, d.top_k, expert_out.shape[1]).sum(dim=1)
