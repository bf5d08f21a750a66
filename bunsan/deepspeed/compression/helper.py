"""`deepspeed.compression.helper`: get and set a submodule by dotted name, and GPT-2's Conv1D as nn.Linear."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["recursive_getattr", "recursive_setattr", "convert_conv1d_to_linear"]


def recursive_getattr(model: nn.Module, module_name: str):
    """`model.a.b.c` for 'a.b.c'."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: nn.Module, module_name: str, module) -> None:
    """Replace `model.a.b.c` by `module` for 'a.b.c'."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Every module of class `convert_type` (transformers' Conv1D: y = x @ W + b, W [in, out]) replaced by the
    nn.Linear that computes the same (weight W transposed), in place; returns the model."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, convert_type)]
    for name, m in targets:
        weight = m.weight.detach()
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=m.bias is not None, device=weight.device,
                           dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight.t())
            if m.bias is not None:
                linear.bias.copy_(m.bias.detach())
        recursive_setattr(model, name, linear)
    return model
