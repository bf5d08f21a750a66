"""Expert parallelism of a transformers MoE model's packed experts (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V3), by the model's own plan: `config.base_model_ep_plan` names the experts module
"ep_dispatch_experts" and its weights "grouped_gemm" (gate_up_proj [E, 2I, h], down_proj [E, h, I]).

Each rank keeps a contiguous run of E/ep experts (the weights sliced along dim 0 under their own names; `ep_split`
and `first` say where the slice sits, as for bunsan's ShardedExperts) and the module's own forward computes them:
hooks around it dispatch its call (hidden_states [T, h], top_k_index [T, k], top_k_weights [T, k]) as

    pre-hook   assignments sorted by expert; counts exchanged; the rows sent by uneven all-to-all to the ranks
               of their experts (dispatch.AllToAllV); the module is called on the received rows (by source
               rank, then expert: its own forward groups them) with each row's local expert and a weight of 1
    hook       the outputs back by all-to-all, weighted by the routing weights, summed per token

so the routing weights' gradient and the rows' gradient come back through the same all-to-alls. A rank (or an
expert) that receives no rows still takes part in every collective. With tensor parallelism each rank slices the
experts its width share was cut to (checkpoints refuse the two cuts at once, as for bunsan's blocks).
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from bunsan.comm.collectives import Comm, Group
from bunsan.expert_parallel.dispatch import AllToAllV
from bunsan.models.packed_experts import experts_call_arguments

__all__ = ["hf_expert_modules", "shard_hf_experts"]

WEIGHTS = ("gate_up_proj", "down_proj")


def hf_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every experts module the model's ep_plan names "ep_dispatch_experts"."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    patterns = [p for p, style in plan.items() if style == "ep_dispatch_experts"]
    if not patterns:
        return []
    base = getattr(model, "base_model_prefix", None)
    if base is not None:        # the plan's paths are under the base model
        patterns = [f"{base}.{p}" if getattr(model, base, None) is not model else p for p in patterns]
    else:                       # a pipeline stage of the model: its modules keep the whole model's names
        patterns = [f"*.{p}" for p in patterns] + patterns
    return [(n, m) for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def shard_hf_experts(experts: nn.Module, name: str, comm: Comm, group: Group) -> None:
    """Keep this rank's E/ep experts of `experts` and dispatch its calls over `group` (module docstring)."""
    extra = sorted(n for n, _ in experts.named_parameters(recurse=False) if n not in WEIGHTS)
    if extra or not all(isinstance(getattr(experts, w, None), nn.Parameter) for w in WEIGHTS):
        raise ValueError(f"{name} ({type(experts).__name__}) is not packed experts of gate_up_proj and down_proj "
                         f"only (it has {extra or 'other weights'}); bunsan's expert parallelism of transformers "
                         "experts splits those two")
    total, ep = experts.gate_up_proj.shape[0], group.size
    if total % ep:
        raise ValueError(f"expert_parallel.autoep_size {ep} does not divide {name}'s {total} experts; pick a "
                         f"divisor of {total}")
    local = total // ep
    experts.first, experts.ep_split = group.rank * local, {}
    for w in WEIGHTS:
        full = getattr(experts, w)
        experts.ep_split[w] = tuple(full.shape)
        mine = full.detach()[experts.first:experts.first + local]
        setattr(experts, w, nn.Parameter(mine if mine.is_meta else mine.clone(), requires_grad=full.requires_grad))
    experts.num_experts = local
    calls: list[tuple] = []     # the dispatch of the call in flight, from the pre-hook to the hook

    def dispatch(module, args, kwargs):
        hidden, index, weights = experts_call_arguments(name, args, kwargs)
        tokens, k = index.shape
        order = torch.argsort(index.reshape(-1), stable=True)      # assignments by (global) expert, then token
        send_counts = torch.bincount(index.reshape(-1), minlength=total).view(ep, local)
        recv_counts = torch.empty_like(send_counts)
        comm.all_to_all(recv_counts, send_counts, group)     # row r: what rank r sends my experts
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()   # host: the collective's sizes
        send, recv = sizes[:ep], sizes[ep:]
        received = AllToAllV.apply(hidden.index_select(0, order // k), recv, send, comm, group)
        # received rows come by source rank, then by my expert: each row's expert, and a weight of 1 (the routing
        # weights apply after the way back)
        runs = torch.arange(local, device=index.device).repeat(ep)
        expert_of = torch.repeat_interleave(runs, recv_counts.reshape(-1), output_size=received.shape[0])
        calls.append((order // k, weights.reshape(-1)[order], send, recv, tokens))
        ones = torch.ones((received.shape[0], 1), dtype=weights.dtype, device=weights.device)
        return (received, expert_of.unsqueeze(1), ones), {}

    def combine(module, args, out):
        token, weights, send, recv, tokens = calls.pop()
        returned = AllToAllV.apply(out, send, recv, comm, group)
        weighted = returned * weights.to(returned.dtype).unsqueeze(-1)
        return returned.new_zeros((tokens, returned.shape[1])).index_add(0, token, weighted)

    # Under tensor parallelism too (tensor_parallel/hf_moe.py, applied before), the dispatch runs first and the
    # combine last: the tensor-parallel hooks then see the received rows (their gradient summed over the group)
    # and the partial outputs of them (summed), and the routing weights apply after that sum, whole
    experts.register_forward_pre_hook(dispatch, with_kwargs=True, prepend=True)
    experts.register_forward_hook(combine)

