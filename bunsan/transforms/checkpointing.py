"""Transforms applied to a plain model from outside, in torchtitan's order:
(tensor parallel) -> activation checkpointing -> compile -> data parallel (the engine).

The model code never learns about them: a transform swaps a block's forward on
the instance, so parameter names and state-dict keys stay those of the plain model.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def transformer_blocks(model: nn.Module, what: str) -> list[nn.Module]:
    """`model.layers`: a ModuleList, or the ModuleDict of the blocks a pipeline stage holds."""
    blocks = getattr(model, "layers", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{what} needs the model's repeated blocks in `model.layers` (an nn.ModuleList); "
                         f"{type(model).__name__} has none: disable {what} or expose its blocks as `layers`")
    return list(blocks)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each transformer block in backward instead of keeping its activations. Returns the count."""
    blocks = transformer_blocks(model, "activation_checkpointing")
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():  # eval / generation: nothing to save, nothing to recompute
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
        block.forward = forward
    return len(blocks)
