"""torch.compile applied block by block, after activation checkpointing (torchtitan's order)."""

from __future__ import annotations

import torch.nn as nn


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (repeated blocks share one compiled graph), else the whole model."""
    blocks = getattr(model, "layers", None)
    if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
            block.compile()
    else:
        model.compile()
