"""`deepspeed.moe.layer.MoE`: DeepSpeed's mixture-of-experts layer, its arguments, module names and result.

    layer = MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor, ...)
    output, l_aux, exp_counts = layer(hidden_states)

Each rank builds num_experts / ep_size copies of `expert` (deep copies, whatever module the user gave, as
DeepSpeed does), marked `allreduce = False` with their `group_name` so `is_moe_param` and
`split_params_into_different_moe_groups_for_optimizer` find them. A forward routes the tokens with the gate
(gating.py), places each kept token in its expert's capacity buffer [E, C, M] and, under expert parallelism,
sends every rank's buffer slices to the ranks that hold those experts by an all-to-all over the mesh's
expert-parallel group (bunsan.initialize binds it: `expert_parallel.autoep_size` is the layers' ep_size),
runs the local experts on what arrives and sends the outputs back, then sums each token's weighted outputs.
The experts' gradients are reduced over the expert-data-parallel group, divided by the data-parallel size
as DeepSpeed divides them (zero/experts.py). `use_residual` is PR-MoE: a dense copy of the expert beside the
experts, mixed per token by a learned 2-way softmax. l_aux is returned for the caller to add (DeepSpeed's way).
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from bunsan.comm.collectives import Comm, Group
from bunsan.deepspeed.moe import gating
from bunsan.expert_parallel.dispatch import AllToAllV

__all__ = ["MoE"]


class TopKGate(nn.Module):
    """The router: `wg` (no bias), applied in fp32, and DeepSpeed's capacity and noise settings."""

    def __init__(self, model_dim: int, num_experts: int, k: int, capacity_factor: float,
                 eval_capacity_factor: float, min_capacity: int, noisy_gate_policy: str | None, drop_tokens: bool,
                 use_rts: bool, top2_2nd_expert_sampling: bool):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy, self.drop_tokens = min_capacity, noisy_gate_policy, drop_tokens
        self.use_rts, self.top2_2nd_expert_sampling = use_rts, top2_2nd_expert_sampling
        self.max_over_group = lambda t: None        # dropless capacity: bound to a MAX all-reduce under EP

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> gating.Routes:
        x = x.float()
        noise = self.noisy_gate_policy if self.training else None
        if noise == "Jitter":
            x = gating.jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return gating.top1(logits, factor, self.min_capacity, used_token, noise, self.drop_tokens,
                               self.use_rts, self.max_over_group)
        if used_token is not None:
            raise ValueError(f"used_token masks tokens for top-1 gating only (DeepSpeed's), got k={self.k}")
        if self.k == 2:
            return gating.top2(logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling,
                               self.max_over_group)
        return gating.topk(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.max_over_group)


class Experts(nn.Module):
    """This rank's copies of the expert; each takes its [ep, C, M] slice of the received buffer."""

    def __init__(self, expert: nn.Module, num_local_experts: int, group_name: str):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False
                p.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for chunk, expert in zip(x.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)   # (an expert returning (out, bias))
        return torch.cat(outs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (see the module docstring)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_size, self.num_local_experts = ep_size, num_local_experts
        self.comm: Comm | None = None
        self.group: Group | None = None
        self.l_aux = self.exp_counts = None

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:
        if self.ep_size > 1 and self.group is None:
            raise RuntimeError(f"this MoE layer has ep_size {self.ep_size} but no expert-parallel group: wrap the "
                               "model with deepspeed.initialize (bunsan binds the group there) before calling it")
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        routes = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        num_experts, capacity = self.ep_size * self.num_local_experts, routes.capacity
        # each route's place in the [E * C] buffer; a dropped route reads (and writes) one spare zero row
        place = torch.where(routes.experts >= 0, routes.experts * capacity + routes.slots,
                            torch.full_like(routes.slots, num_experts * capacity))
        source = torch.full((num_experts * capacity + 1,), tokens.shape[0], dtype=torch.long, device=x.device)
        source.scatter_(0, place.reshape(-1), torch.arange(tokens.shape[0], device=x.device).repeat(place.shape[0]))
        padded = torch.cat([tokens, tokens.new_zeros(1, dim)])
        buffer = padded.index_select(0, source[:-1]).view(num_experts, capacity, dim)
        buffer = self._exchange(buffer)
        out = self.experts(buffer.reshape(self.ep_size, self.num_local_experts, capacity, dim))
        out = self._exchange(out.reshape(num_experts, capacity, dim)).reshape(num_experts * capacity, dim)
        routed = torch.cat([out, out.new_zeros(1, dim)]).index_select(0, place.reshape(-1))
        combined = (routed.view(place.shape[0], tokens.shape[0], dim) * routes.weights.unsqueeze(-1)).sum(0)
        return combined.to(out.dtype).reshape(x.shape)

    def _exchange(self, buffer: torch.Tensor) -> torch.Tensor:
        """[E, C, M]: rank r's slices of the experts rank j holds go to j (and back, the same call)."""
        if self.ep_size == 1:
            return buffer
        rows = [buffer.shape[0] // self.ep_size] * self.ep_size
        flat = buffer.reshape(buffer.shape[0], -1)
        return AllToAllV.apply(flat, rows, rows, self.comm, self.group).view(buffer.shape)


class MoE(nn.Module):
    """DeepSpeed's MoE layer (see the module docstring); the arguments and defaults are DeepSpeed 0.19's."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        for name, v in (("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoE {name} must be a positive int, got {v!r}")
        if num_experts % ep_size:
            raise ValueError(f"MoE num_experts {num_experts} is not divisible by ep_size {ep_size}: each rank of "
                             f"the expert-parallel group holds num_experts / ep_size experts")
        if k > num_experts:
            raise ValueError(f"MoE k {k} exceeds num_experts {num_experts}")
        if noisy_gate_policy not in gating.NOISE_POLICIES:
            raise ValueError(f"MoE noisy_gate_policy {noisy_gate_policy!r} is not one of 'None', 'Jitter', "
                             "'RSample' or None")
        if noisy_gate_policy == "RSample" and k != 1:
            raise ValueError("MoE noisy_gate_policy 'RSample' noises top-1 gating only (DeepSpeed applies it for "
                             f"k=1); got k={k}: use 'Jitter' or None")
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE enable_expert_tensor_parallelism: experts split by tensor parallelism are not "
                             "built; set it to False (experts are split over ranks by ep_size)")
        if use_tutel:
            raise ValueError("MoE use_tutel: Tutel's kernels are not used by bunsan; set use_tutel=False (the "
                             "routing and results are the same without it)")
        self.use_residual, self.ep_size, self.num_experts = use_residual, ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        None if noisy_gate_policy == "None" else noisy_gate_policy, drop_tokens, use_rts,
                        top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def bind_expert_parallel(self, comm: Comm, group: Group) -> None:
        """The expert-parallel group this layer's all-to-alls and dropless capacity use (bunsan.initialize)."""
        if group.size != self.ep_size:
            raise ValueError(f"this MoE layer has ep_size {self.ep_size} but the expert-parallel group has "
                             f"{group.size} ranks; every MoE layer of a model takes one ep_size in bunsan")
        self.deepspeed_moe.comm, self.deepspeed_moe.group = comm, group
        self.deepspeed_moe.gate.max_over_group = lambda t: comm.all_reduce(t, group, op="max")

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls it to make the groups; bunsan.initialize binds them (bind_expert_parallel)."""

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + dense * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
