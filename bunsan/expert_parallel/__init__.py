"""Expert parallelism: each MoE block's experts split over the mesh's expert-parallel group, tokens dispatched
to them by all-to-all (dispatch.py). Applied from outside, as tensor parallelism is: the model keeps its plain
MoE blocks (models/moe.py) and the same parameter names; only the experts' weights hold this rank's slice.

A transformers MoE model's packed experts (its config's ep_plan: "ep_dispatch_experts") keep their share the same
way, their own forward dispatched by hooks (hf_experts.py).

A layer that builds only its own share of the experts itself (DeepSpeed's MoE, bunsan.deepspeed.moe) says so
with a `bind_expert_parallel(comm, group)` method and an `ep_size`, and marks its expert parameters
`allreduce = False` (DeepSpeed's mark); it is bound to the group rather than split.

    apply_expert_parallel(model, ctx)   every MoE block's GroupedExperts -> ShardedExperts; layers bound
    expert_parameter_names(model)       the weights reduced over the expert-data-parallel group
    consolidate(state, model, ctx)      full expert weights under the plain keys (a bound layer's experts
                                        numbered globally: rank r's local expert i is r * local + i)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bunsan.comm.collectives import Comm, Group
from bunsan.expert_parallel.dispatch import ShardedExperts
from bunsan.expert_parallel.hf_experts import hf_expert_modules, shard_hf_experts
from bunsan.models.moe import MoE

__all__ = ["EPContext", "ShardedExperts", "apply_expert_parallel", "check_has_experts", "consolidate",
           "expert_parameter_names",
           "expert_unit_classes", "global_expert_names", "moe_blocks"]


@dataclass
class EPContext:
    comm: Comm
    group: Group          # the ranks that split the experts (Mesh.ep_group)
    edp_group: Group      # the replicas of this rank's experts (Mesh.edp_group)
    tp_group: Group | None = None     # each expert's width also cut over it (tensor parallelism)

    @property
    def size(self) -> int:
        return self.group.size


def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """(path, block) of every bunsan MoE block in the model."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def bound_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, layer) of every layer that holds its own share of the experts (see the module docstring)."""
    return [(n, m) for n, m in model.named_modules() if callable(getattr(m, "bind_expert_parallel", None))]


def check_has_experts(model: nn.Module, ep: int) -> None:
    """A model without experts bunsan can split is refused (under EP its experts would train whole on every
    rank); checked on the whole model before a pipeline cuts it (a stage may hold none)."""
    if not (moe_blocks(model) or bound_layers(model) or hf_expert_modules(model)):
        raise ValueError(f"expert_parallel.autoep_size {ep} but {type(model).__name__} has no bunsan MoE "
                         "blocks (bunsan.models.moe.MoE) to split: expert parallelism acts on bunsan's Llama with "
                         "model.moe set (e.g. the tiny-moe preset), on deepspeed.moe.layer.MoE layers and on a "
                         "transformers MoE model's experts (its config's ep_plan); set expert_parallel.enabled false")


def apply_expert_parallel(model: nn.Module, ctx: EPContext) -> int:
    """Split every MoE block's experts over ctx.group and bind every layer that splits its own; how many (a
    pipeline stage of dense layers only: none)."""
    blocks, layers, packed = moe_blocks(model), bound_layers(model), hf_expert_modules(model)
    for name, layer in layers:
        if layer.ep_size != ctx.size:
            raise ValueError(f"{name} is a MoE layer of ep_size {layer.ep_size} but expert_parallel.autoep_size "
                             f"is {ctx.size}; bunsan folds one expert-parallel size: give every layer the same "
                             "ep_size and set autoep_size to it")
        layer.bind_expert_parallel(ctx.comm, ctx.group)
    for name, experts in packed:
        shard_hf_experts(experts, name, ctx.comm, ctx.group)
    for _, block in blocks:
        if block.config.num_experts % ctx.size:
            raise ValueError(f"expert_parallel.autoep_size {ctx.size} does not divide num_experts "
                             f"{block.config.num_experts}: each rank holds a whole number of experts; pick a "
                             f"divisor of {block.config.num_experts}")
        block.experts = ShardedExperts(block.experts, ctx.comm, ctx.group, ctx.tp_group)
    return len(blocks) + len(layers) + len(packed)


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names (model.named_parameters) of the expert weights this rank holds a share of."""
    sliced = {f"{n}.{p}" for n, m in model.named_modules() if getattr(m, "ep_split", None)
              for p, _ in m.named_parameters(recurse=False)}
    marked = {n for n, p in model.named_parameters() if getattr(p, "allreduce", True) is False}
    return sliced | marked


def expert_unit_classes(model: nn.Module) -> list[str]:
    """Class names of the modules that hold (and compute) a rank's experts: what ZeRO-3 gathers as units of
    the experts' own strategy (a bound layer's experts container, bunsan's ShardedExperts, a transformers
    model's packed experts)."""
    names = {type(m).__name__ for m in model.modules() if getattr(m, "ep_split", None)}
    names |= {type(m.deepspeed_moe.experts).__name__ for _, m in bound_layers(model)}
    return sorted(names)


def global_expert_names(model: nn.Module, ctx: EPContext, keys=None) -> dict[str, list[str]]:
    """A bound layer's local expert keys (of `keys`, default its parameters' names) -> the same tensor's key
    on every rank of the group, in rank order (rank r's local expert i is expert r * local + i)."""
    keys = [n for n, _ in model.named_parameters()] if keys is None else keys
    out = {}
    for name, layer in bound_layers(model):
        local = layer.num_local_experts
        prefix = f"{name}.deepspeed_moe.experts.deepspeed_experts." if name else \
            "deepspeed_moe.experts.deepspeed_experts."
        for key in keys:
            if key.startswith(prefix):
                i, _, rest = key[len(prefix):].partition(".")
                out[key] = [f"{prefix}{r * local + int(i)}.{rest}" for r in range(ctx.size)]
    return out


def consolidate(state: dict[str, torch.Tensor], model: nn.Module, ctx: EPContext,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Full expert weights from every rank's slice, all-gathered over the expert-parallel group (in expert
    order: rank r holds the r-th run), under the plain model's keys. Collective over ctx.group."""
    out = dict(state)
    for key, keys in global_expert_names(model, ctx, list(state)).items():
        mine = state[key].contiguous().to(device)
        every = torch.empty((ctx.size, *mine.shape), dtype=mine.dtype, device=device)
        ctx.comm.all_gather(every, mine, ctx.group)
        del out[key]
        out.update({k: t.cpu() for k, t in zip(keys, every)})     # host: the consolidated state dict lives there
    for name, m in model.named_modules():
        for pname, full_shape in (getattr(m, "ep_split", None) or {}).items():
            key = f"{name}.{pname}"
            if key not in state:
                continue
            mine = state[key].contiguous().to(device)      # NCCL gathers device tensors
            full = torch.empty(full_shape, dtype=mine.dtype, device=device)
            ctx.comm.all_gather(full, mine, ctx.group)
            out[key] = full.cpu()     # host: the consolidated state dict lives on the CPU
    return out
