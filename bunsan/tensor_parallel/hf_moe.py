"""Tensor parallelism of a transformers MoE block's packed experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3 in transformers 5): the plan's "moe_tp_experts" on the experts module, with its parameters'
"packed_colwise" (gate_up_proj [E, 2I, h]: the gate's I rows then the up's, each cut over the ranks) and
"rowwise" (down_proj [E, h, I], cut along I). Every rank computes every routed token's partial output over its
share of each expert's width; the router stays whole on every rank.

    experts' input     enters the parallel region: its gradient (partial per rank) summed over the group
    routing weights    their gradient summed too: on a rank it is the partial outputs' share
    experts' output    partial sums, summed over the group once

With both sums at the experts module, everything upstream (the router, its logits, the block's input) gets whole
gradients on every rank, and transformers' auxiliary loss (computed from the router logits, the same on every
rank) is not counted tp times. The block above the experts is therefore not a parallel input itself.
"""

from __future__ import annotations

import torch
from torch import nn

from bunsan.models.packed_experts import experts_call_arguments
from bunsan.tensor_parallel.layers import split_rows
from bunsan.tensor_parallel.ops import CopyToTP, TPContext, sum_over_tp

__all__ = ["split_hf_experts", "EXPERT_PARAM_STYLES"]

# the experts' parameters and the style transformers' plans give each (checked, then split here)
EXPERT_PARAM_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def _cut(w: torch.Tensor, dim: int, sections: int, ctx: TPContext) -> nn.Parameter:
    """This rank's rows of `w` along `dim`, from each of `sections` equal sections (a packed gate and up)."""
    parts = w.detach().movedim(dim, 0).chunk(sections)
    mine = torch.cat([split_rows(p, ctx.size, ctx.rank) for p in parts]).movedim(0, dim).contiguous()
    return nn.Parameter(mine, requires_grad=w.requires_grad)


def split_hf_experts(experts: nn.Module, name: str, ctx: TPContext) -> None:
    """Split a transformers experts module over ctx.group in place (see the module docstring)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter) or gate_up.dim() != 3:
        raise ValueError(f"tensor-parallel style 'moe_tp_experts' splits packed experts (gate_up_proj [E, 2I, h], "
                         f"down_proj [E, h, I] parameters); {name} is a {type(experts).__name__} without them")
    extra = sorted(n for n, _ in experts.named_parameters(recurse=False) if n not in EXPERT_PARAM_STYLES)
    if extra:
        raise ValueError(f"{name} ({type(experts).__name__}) has parameters {extra} beside gate_up_proj and "
                         "down_proj, which bunsan's split of packed experts does not cut; train it without "
                         "tensor parallelism")
    width = down.shape[2]
    if gate_up.shape[1] != 2 * width or width % ctx.size:
        raise ValueError(f"tensor_parallel.size {ctx.size} does not divide {name}'s expert width {width} (or "
                         f"gate_up_proj {tuple(gate_up.shape)} is not [E, 2 x {width}, h]); use a size that "
                         f"divides {width}")
    experts.tp_split = {"gate_up_proj": (tuple(gate_up.shape), 1), "down_proj": (tuple(down.shape), 2)}
    experts.tp_sections = {"gate_up_proj": 2}      # each rank's rows of the gate and of the up, side by side
    experts.gate_up_proj = _cut(gate_up, 1, 2, ctx)
    experts.down_proj = _cut(down, 2, 1, ctx)
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = width // ctx.size

    def enter(module, args, kwargs):
        hidden, index, weights = experts_call_arguments(name, args, kwargs)
        hidden = CopyToTP.apply(ctx, hidden, None) if hidden.requires_grad else hidden
        weights = CopyToTP.apply(ctx, weights, None) if weights.requires_grad else weights
        return (hidden, index, weights), {}

    experts.register_forward_pre_hook(enter, with_kwargs=True)
    experts.register_forward_hook(lambda module, args, out: sum_over_tp(ctx, out))
