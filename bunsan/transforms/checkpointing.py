"""Transforms applied to a plain model from outside, in torchtitan's order:
(tensor parallel) -> activation checkpointing -> compile -> data parallel (the engine).

The model code never learns about them: a transform swaps a block's forward on
the instance, so parameter names and state-dict keys stay those of the plain model.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from bunsan.models.blocks import repeated_blocks


def transformer_blocks(model: nn.Module, what: str) -> list[nn.Module]:
    """The model's repeated blocks (models/blocks.py); none found is an error naming the ways to say them."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{what} needs the model's repeated blocks: `model.layers` (an nn.ModuleList), or a "
                         f"Hugging Face model's `_no_split_modules`; {type(model).__name__} has neither: disable "
                         f"{what} or expose its blocks as `layers`")
    return blocks


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
