"""A model's repeated blocks (its transformer layers): what ZeRO-3 gathers as units, what activation
checkpointing recomputes. bunsan's Llama holds them in `model.layers`; a Hugging Face model names their
class in `_no_split_modules` (LlamaDecoderLayer, Qwen2DecoderLayer, GPT2Block, ...)."""

from __future__ import annotations

import torch.nn as nn

# The ops of a Llama-shaped block that selective recompute (transforms/selective.py) may re-run in backward
# besides the elementwise ones: the attention core (SDPA) and the SwiGLU activation silu(gate) * up.
SELECTIVE_OPS = ("attention", "swiglu")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """`model.layers` (a ModuleList, or the ModuleDict of the blocks a pipeline stage holds), else the modules
    whose class a Hugging Face model lists in `_no_split_modules`, else the largest run of same-class modules
    in one ModuleList anywhere in the model (`self.blocks`, `self.transformer.h`: how hand-written GPTs hold
    their blocks, and what FSDP users wrap); in order; [] when there is none."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names and m is not model]
    return _largest_module_list(model)


def _largest_module_list(model: nn.Module) -> list[nn.Module]:
    best, best_size = [], 0
    for m in model.modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2 or len({type(c) for c in m}) != 1:
            continue
        if type(m[0]).forward is nn.Module.forward:       # containers are never called: no hooks would run
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            best, best_size = list(m), size
    return best
