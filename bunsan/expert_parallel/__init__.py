"""Expert parallelism: each MoE block's experts split over the mesh's expert-parallel group, tokens dispatched
to them by all-to-all (dispatch.py). Applied from outside, as tensor parallelism is: the model keeps its plain
MoE blocks (models/moe.py) and the same parameter names; only the experts' weights hold this rank's slice.

    apply_expert_parallel(model, ctx)   every MoE block's GroupedExperts -> ShardedExperts
    expert_parameter_names(model)       the weights reduced over the expert-data-parallel group
    consolidate(state, model, ctx)      full expert weights (all-gathered along dim 0) under the plain keys
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bunsan.comm.collectives import Comm, Group
from bunsan.expert_parallel.dispatch import ShardedExperts
from bunsan.models.moe import MoE

__all__ = ["EPContext", "ShardedExperts", "apply_expert_parallel", "consolidate", "expert_parameter_names",
           "moe_blocks"]


@dataclass
class EPContext:
    comm: Comm
    group: Group          # the ranks that split the experts (Mesh.ep_group)
    edp_group: Group      # the replicas of this rank's experts (Mesh.edp_group)

    @property
    def size(self) -> int:
        return self.group.size


def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """(path, block) of every bunsan MoE block in the model."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, ctx: EPContext) -> int:
    """Split every MoE block's experts over ctx.group; the number of blocks split. A model without bunsan MoE
    blocks is refused: its experts (a transformers model's own) would be trained whole on every rank."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"expert_parallel.autoep_size {ctx.size} but {type(model).__name__} has no bunsan MoE "
                         "blocks (bunsan.models.moe.MoE) to split: expert parallelism acts on bunsan's Llama with "
                         "model.moe set (e.g. the tiny-moe preset); set expert_parallel.enabled false")
    for _, block in blocks:
        if block.config.num_experts % ctx.size:
            raise ValueError(f"expert_parallel.autoep_size {ctx.size} does not divide num_experts "
                             f"{block.config.num_experts}: each rank holds a whole number of experts; pick a "
                             f"divisor of {block.config.num_experts}")
        block.experts = ShardedExperts(block.experts, ctx.comm, ctx.group)
    return len(blocks)


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names (model.named_parameters) of the expert weights this rank holds a slice of."""
    return {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, ShardedExperts)
            for p, _ in m.named_parameters(recurse=False)}


def consolidate(state: dict[str, torch.Tensor], model: nn.Module, ctx: EPContext,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Full expert weights from every rank's slice, all-gathered over the expert-parallel group (in expert
    order: rank r holds the r-th run), under the plain model's keys. Collective over ctx.group."""
    out = dict(state)
    for name, m in model.named_modules():
        if not isinstance(m, ShardedExperts):
            continue
        for pname, full_shape in m.ep_split.items():
            key = f"{name}.{pname}"
            if key not in state:
                continue
            mine = state[key].contiguous().to(device)      # NCCL gathers device tensors
            full = torch.empty(full_shape, dtype=mine.dtype, device=device)
            ctx.comm.all_gather(full, mine, ctx.group)
            out[key] = full.cpu()     # host: the consolidated state dict lives on the CPU
    return out
