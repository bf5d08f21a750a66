"""ZeRO-3's units: the groups of parameters gathered and released together, how they are found, and the
autograd hook that re-gathers a unit before backward reaches it (stage3.py drives them)."""

from __future__ import annotations

import torch
import torch.nn as nn

from bunsan.models.blocks import repeated_blocks

from bunsan.zero.unit_buffer import UnitBuffer


class PreBackward(torch.autograd.Function):
    """Identity whose backward gathers a unit before autograd reaches its parameters."""

    @staticmethod
    def forward(ctx, owner, k, x):
        ctx.owner, ctx.k = owner, k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.pre_backward(ctx.k)
        return None, None, grad


class UnitHandles:
    """One wait for a unit's all-gathers (trained and frozen parts)."""

    def __init__(self, handles: list):
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class Unit:
    """A group of parameters gathered and released together (a block, or the root of what is left)."""

    def __init__(self, module: nn.Module | None, params: list[int]):
        self.module, self.params = module, params
        self.buf: UnitBuffer | None = None       # the unit's gathered storage; holds no memory while released
        self.gathered = False
        self.pending = None                      # the handle of a prefetch in flight
        self.persistent = False
        self.in_backward = False


def find_units(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """The modules whose class is named in stage3_unit_modules, else the model's repeated blocks
    (`model.layers`, or a Hugging Face model's `_no_split_modules`)."""
    if class_names:
        units = [m for m in model.modules() if type(m).__name__ in class_names and m is not model]
        if not units:
            raise ValueError(f"zero_optimization.stage3_unit_modules {class_names} matched no module of "
                             f"{type(model).__name__}; list class names of its blocks")
        containers = sorted({type(m).__name__ for m in units if type(m).forward is nn.Module.forward})
        if containers:   # a unit is gathered by its forward pre-hook: one never called would compute on zeros
            raise ValueError(f"zero_optimization.stage3_unit_modules names {containers}, a container whose "
                             "forward is never called, so its parameters would never be gathered; list the "
                             "class names of the blocks inside it instead")
        return units
    return repeated_blocks(model)
