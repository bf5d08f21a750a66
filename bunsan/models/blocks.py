"""A model's repeated blocks (its transformer layers): what ZeRO-3 gathers as units, what activation
checkpointing recomputes. bunsan's Llama holds them in `model.layers`; a Hugging Face model names their
class in `_no_split_modules` (LlamaDecoderLayer, Qwen2DecoderLayer, GPT2Block, ...)."""

from __future__ import annotations

import torch.nn as nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """`model.layers` (a ModuleList, or the ModuleDict of the blocks a pipeline stage holds), else the modules
    whose class a Hugging Face model lists in `_no_split_modules`, in order; [] when neither says."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]
