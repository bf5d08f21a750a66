"""Tensor parallelism of bunsan's MoE block (models/moe.py): every expert's width split over the group (Megatron's
expert tensor parallelism with ETP = TP), the router whole on every rank.

    input      the block's input enters the parallel region (the plan's style "moe" acts as parallel_input):
               whole on every rank (all-gathered along the sequence under SP), its gradient summed back
    router     whole on every rank, the same routing everywhere; its weight's gradient is summed over the group
               (each rank's share of it comes from its own part of the experts' outputs, below)
    experts    w1, w3 [E, I, h] split along I, w2 [E, h, I] along I: each rank computes every routed token's
               partial output; the shared experts' projections alike (gate/up by rows, down by columns)
    output     routed and shared partial outputs added, then summed over the group once (reduce-scattered
               along the sequence under SP)
    balancing  every rank computes the same auxiliary and z losses: each gives 1/tp of their gradient

The routing weights' gradient on a rank is its partial outputs' share; everything upstream of it (router,
block input) is linear in it, so the group's sum (the router weight's summed gradient, the input's summed
gradient) is the whole. Parameters keep their names; `tp_split` says how each was cut.
"""
from __future__ import annotations

import torch
from torch import nn

from bunsan.models.moe import MoE
from bunsan.tensor_parallel.layers import split_rows, sum_grad_over_tp
from bunsan.tensor_parallel.ops import TPContext, out_of_parallel_region

__all__ = ["split_moe_block", "check_moe"]


def check_moe(block: MoE, name: str, tp: int) -> None:
    c = block.config
    widths = [("expert_intermediate_size", c.expert_intermediate_size)]
    if c.shared_width:
        widths.append(("shared experts' width", c.shared_width))
    for what, n in widths:
        if n % tp:
            raise ValueError(f"tensor_parallel.size {tp} does not divide {name}'s {what} ({n}); use a "
                             f"tensor-parallel size that divides {n}")


def _split_dim(w: torch.Tensor, dim: int, ctx: TPContext) -> nn.Parameter:
    part = split_rows(w.detach().movedim(dim, 0), ctx.size, ctx.rank).movedim(0, dim).contiguous()
    return nn.Parameter(part, requires_grad=w.requires_grad)


def _split_linear(linear: nn.Linear, dim: int, ctx: TPContext) -> None:
    """An nn.Linear kept as one, its weight cut along `dim` (0: output rows, 1: input columns): its output is
    this rank's slice (dim 0) or partial sum (dim 1), which the block's single reduction completes."""
    full = tuple(linear.weight.shape)
    linear.weight = _split_dim(linear.weight, dim, ctx)
    linear.tp_split = {"weight": (full, dim)}
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def split_moe_block(block: MoE, name: str, ctx: TPContext) -> None:
    """Split `block` over ctx.group in place (see the module docstring)."""
    check_moe(block, name, ctx.size)
    experts = block.experts
    experts.tp_split = {}
    for w, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
        experts.tp_split[w] = (tuple(getattr(experts, w).shape), dim)
        setattr(experts, w, _split_dim(getattr(experts, w), dim, ctx))
    experts.hidden //= ctx.size
    if block.shared_experts is not None:
        _split_linear(block.shared_experts.gate_proj, 0, ctx)
        _split_linear(block.shared_experts.up_proj, 0, ctx)
        _split_linear(block.shared_experts.down_proj, 1, ctx)
    sum_grad_over_tp(block.gate.weight, ctx)
    block.aux_grad_share = 1.0 / ctx.size
    block.reduce_output = lambda out: out_of_parallel_region(ctx, out)
