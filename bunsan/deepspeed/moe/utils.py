"""`deepspeed.moe.utils`: the parameter-group helpers, for models without expert layers (bunsan has none)."""

from __future__ import annotations

import torch

__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether `param` belongs to an expert: never in bunsan (DeepSpeed marks experts' with `allreduce=False`)."""
    if getattr(param, "allreduce", True) is False:
        raise ValueError("a parameter marked allreduce=False (a DeepSpeed expert parameter): bunsan has no "
                         "mixture-of-experts support")
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=None):
    """DeepSpeed splits expert parameters into their own groups; without experts the groups stay as they are."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for g in groups:
        for p in g["params"]:
            is_moe_param(p)
    return groups
