"""torch.compile applied block by block, after activation checkpointing (torchtitan's order)."""

from __future__ import annotations

import torch
import torch.nn as nn

from bunsan.models.moe_experts import GroupedExperts


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (repeated blocks share one compiled graph), else the whole model. A MoE
    block's experts run eagerly inside their compiled block (the graph breaks there and resumes after): the
    grouped GEMM's meta function takes bf16 only where the CPU kernel runs fp32 too, and under expert parallelism
    the all-to-all reads its sizes on the host and calls the process group, which a graph cannot hold."""
    for m in model.modules():
        if isinstance(m, GroupedExperts) or getattr(m, "ep_split", None):
            m.forward = torch.compiler.disable(m.forward)
    blocks = getattr(model, "layers", None)
    if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks):
            block.compile()
    else:
        model.compile()
