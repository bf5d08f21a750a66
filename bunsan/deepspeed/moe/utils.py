"""`deepspeed.moe.utils`: DeepSpeed's helpers for models with MoE layers (moe/layer.py), its semantics.

An expert parameter is one marked `allreduce = False` (the layer's Experts mark theirs, with `group_name`
"ep_size_N"). The optimizer helpers split every group in two: its dense parameters, and per expert group a
copy of the group's settings with `name` the expert group, `moe` True and the experts' parameters (cut into
groups of at most `max_group_size` elements), appended after all the dense groups, as DeepSpeed orders them;
groups without experts are left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group", "split_params_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "configure_moe_param_groups"]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` holds a deepspeed.moe.layer.MoE, the first one's num_experts)."""
    from bunsan.deepspeed.moe.layer import MoE
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    shared, experts = [], []
    for p in params:
        (experts if is_moe_param(p) else shared).append(p)
    return shared, experts


def _as_groups(param_groups) -> list[dict]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"param_groups must be a dict or a list or tuple of dicts, got {type(param_groups).__name__}")


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """Every group's expert parameters moved into groups of their own (see the module docstring). Each group
    needs a `name`, as DeepSpeed's does."""
    groups = _as_groups(param_groups)
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"param group {i} must be a dict with 'params', got {type(g).__name__}")
        g["params"] = list(g["params"])
    expert_names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    for i, g in enumerate(groups):
        if expert_names and "name" not in g:
            raise ValueError(f"param group {i} has no 'name': DeepSpeed keys the expert groups by it; add "
                             "'name' to each group (e.g. {'params': ..., 'name': 'parameters'})")
    moved = []
    for g in groups:
        for name in expert_names:
            members = [p for p in g["params"] if is_moe_param(p) and p.group_name == name]
            moved.append(({**g, "name": name, "moe": True}, members))
        g["params"] = [p for p in g["params"] if not is_moe_param(p)]
    for settings, members in moved:
        if max_group_size is None:
            groups.append({**settings, "params": members})
            continue
        chunk, size = [], 0
        for p in members:
            n = getattr(p, "ds_numel", p.numel())
            if chunk and size + n > max_group_size:
                groups.append({**settings, "params": chunk})
                chunk, size = [], 0
            chunk.append(p)
            size += n
        groups.append({**settings, "params": chunk})
    return groups


def configure_moe_param_groups(model_parameters: list) -> list:
    """What DeepSpeed's engine does with model_parameters when the model has MoE layers."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, got {type(model_parameters).__name__}")
    if not model_parameters:
        raise ValueError("model_parameters is empty: nothing to optimize")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"model_parameters holds tensors or dicts, got {type(p).__name__}")
    if isinstance(model_parameters[0], torch.Tensor):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if any("moe" in g for g in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
