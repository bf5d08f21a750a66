"""bunsan's mixture-of-experts block: a drop-in for a dense MLP, [..., hidden] in, [..., hidden] out.

    logits   = x @ gate^T (fp32)                          router (models/moe_router.py)
    experts  = the k best per token, weights              route(): softmax/sigmoid, expert bias, groups
    sorted   = tokens grouped by expert, counts           dispatch() (models/moe_dispatch.py)
    y        = SwiGLU experts on the sorted tokens        GroupedExperts (models/moe_experts.py)
    out      = sum_k weight * y  (+ shared experts(x))    combine()

Plain PyTorch and single-process: expert parallelism (bunsan/expert_parallel/) swaps `experts` for this rank's
share with the all-to-all around it, tensor parallelism (tensor_parallel/moe.py) cuts every expert's width.

Balancing, as configured (MoEConfig): after each forward `last_losses` holds the auxiliary and z losses that
are on (0-dim fp32 tensors attached to the router), and `aux_loss` their coefficient-weighted sum, which a
plain loop adds to its training loss. A training engine instead sets `aux_grad_scale`: the block then
attaches aux_loss to its output's backward with that gradient (Megatron's MoEAuxLossAutoScaler), so the
losses train the router from wherever the block sits (a pipeline stage without the loss, a recomputed
block) and the caller adds nothing; `last_losses` and `aux_loss` are then detached values, for metrics.
DeepSeek-V3's auxiliary-loss-free balancing instead moves the `expert_bias` buffer once per optimizer step:
the training step calls `update_expert_bias()` after `optimizer.step()` (engine/moe_step.py does). Tokens per
expert (and assignments dropped for capacity) accumulate in `tokens_per_expert` and `dropped_per_expert` over
the training forwards until read by `take_expert_counts()` or `update_expert_bias()`. A forward run again by
activation checkpointing counts again: every count doubles alike, so the bias update's signs and the load
shares the engine reports are unchanged (these counts never steer the gradients).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from bunsan.models.moe_config import MoEConfig
from bunsan.models.moe_dispatch import combine, dispatch
from bunsan.models.moe_experts import GroupedExperts
from bunsan.models.moe_router import load_balancing_loss, route, router_z_loss
from bunsan.models.saving import swiglu


class SharedExperts(nn.Module):
    """The dense SwiGLU MLP every token passes (DeepSeek's shared experts, fused into one MLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class _AttachLoss(torch.autograd.Function):
    """Identity on `out` whose backward also gives `loss` the gradient `scale`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class Router(nn.Linear):
    """The gate: one logit per expert, in fp32 whatever the model dtype (which experts win is decided by small
    differences). Its own class, called as a module: a pass that swaps plain nn.Linear layers (serving's
    prepacked GEMMs) leaves it as it is."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class MoE(nn.Module):
    """Token-choice top-k MoE with optional shared experts (see the module docstring)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE takes a MoEConfig, got {type(config).__name__}")
        self.config = copy.deepcopy(config)     # own copy: a config shared by the layers stays untouched
        c = self.config
        self.gate = Router(c.hidden_size, c.num_experts)
        self.experts = GroupedExperts(c.num_experts, c.hidden_size, c.expert_intermediate_size, c.expert_kernel)
        self.shared_experts = SharedExperts(c.hidden_size, c.shared_width) if c.shared_width else None
        # Selection-only bias (DeepSeek-V3's e_score_correction_bias): model state, so it is saved
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))   # default device: where the block is built
        # This step's counts: recomputable from the data, so kept out of checkpoints
        counts = torch.zeros(c.num_experts, dtype=torch.int64)   # default device: where the block is built
        self.register_buffer("tokens_per_expert", counts, persistent=False)
        self.register_buffer("dropped_per_expert", counts.clone(), persistent=False)
        self.last_losses: dict[str, torch.Tensor] = {}
        self.last_counts: torch.Tensor | None = None     # [E] assignments chosen per expert, last forward
        self.last_dropped: torch.Tensor | None = None    # [E] of them dropped for capacity, last forward
        self.aux_grad_scale: float | None = None         # set by an engine: attach aux_loss to the backward
        # Set by tensor parallelism (tensor_parallel/moe.py), which splits every expert's width: this copy's
        # share of the balancing losses' gradient (each rank computes the same losses), and the sum of the
        # ranks' partial outputs (None: the output is whole)
        self.aux_grad_share = 1.0
        self.reduce_output = None
        if not self.gate.weight.is_meta:    # on meta: allocate nothing, init after to_empty()
            self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if x.shape[-1:] != (c.hidden_size,) or not x.is_floating_point():
            raise ValueError(f"MoE input must be a float tensor [..., hidden_size={c.hidden_size}], got "
                             f"{x.dtype} of shape {tuple(x.shape)}")
        flat = x.reshape(-1, c.hidden_size)
        logits = self.gate(flat)
        routing = route(logits, c, self.expert_bias)
        d = dispatch(routing.experts, routing.weights, c.num_experts, c.capacity(flat.shape[0]), c.drop_policy)
        out = combine(self.experts(flat.index_select(0, d.token_index), d.counts), d)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        losses = {}
        if c.aux_loss_coef:
            losses["aux"] = load_balancing_loss(routing, c.num_experts, c.score_func)
        if c.z_loss_coef:
            losses["z"] = router_z_loss(routing.logits)
        self.last_losses = losses
        if self.aux_grad_scale is not None:
            if losses and torch.is_grad_enabled():
                out = _AttachLoss.apply(out, self.aux_loss, float(self.aux_grad_scale) * self.aux_grad_share)
            # kept for the metrics only: attached, they would hold the step's graph (and through an engine's
            # hooks in it, the engine) alive after backward
            self.last_losses = {k: v.detach() for k, v in losses.items()}
        self.last_counts, self.last_dropped = d.routed.detach(), d.dropped.detach()
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(d.routed)
                self.dropped_per_expert.add_(d.dropped)
        out = out.view(x.shape)
        return out if self.reduce_output is None else self.reduce_output(out)

    @property
    def aux_loss(self) -> torch.Tensor:
        """aux_loss_coef * aux + z_loss_coef * z of the last forward: a 0-dim fp32 tensor for the caller to
        add to the loss (0, unattached, when neither loss is on)."""
        c = self.config
        total = self.expert_bias.new_zeros(())
        for name, coef in (("aux", c.aux_loss_coef), ("z", c.z_loss_coef)):
            if name in self.last_losses:
                total = total + coef * self.last_losses[name]
        return total

    @torch.no_grad()
    def take_expert_counts(self) -> dict[str, torch.Tensor]:
        """The counts accumulated since the last take, {"tokens": [E], "dropped": [E]} (int64), and reset them."""
        taken = {"tokens": self.tokens_per_expert.clone(), "dropped": self.dropped_per_expert.clone()}
        self.tokens_per_expert.zero_()
        self.dropped_per_expert.zero_()
        return taken

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step (after `optimizer.step()`):

            expert_bias += expert_bias_update_rate * sign(mean(counts) - counts)

        so an overloaded expert is chosen less next step and an idle one more. counts [E]: the step's tokens
        per expert over all its micro-batches; None: this block's accumulated `tokens_per_expert`. Under data
        parallelism the caller passes the counts summed over the ranks (all-reduced), so every replica moves
        its bias alike. The accumulated counts are taken (reset) either way and returned for the metrics.
        """
        rate = self.config.expert_bias_update_rate
        if rate == 0:
            raise ValueError("MoE.update_expert_bias called with expert_bias_update_rate 0: the bias would never "
                             "move; set MoEConfig.expert_bias_update_rate > 0 (DeepSeek-V3 used 0.001)")
        taken = self.take_expert_counts()
        counts = taken["tokens"] if counts is None else counts
        if counts.shape != self.expert_bias.shape:
            raise ValueError(f"counts must have one entry per expert {tuple(self.expert_bias.shape)}, got "
                             f"{tuple(counts.shape)}")
        counts = counts.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias.add_(rate * torch.sign(counts.mean() - counts))
        return taken

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """normal(0, std) weights, normal(0, out_std or std) for the projections back into the residual (w2,
        down_proj); the expert bias and the counts to 0."""
        self.gate.weight.normal_(0.0, std)
        self.experts.reset_parameters(std, out_std)
        if self.shared_experts is not None:
            for proj in (self.shared_experts.gate_proj, self.shared_experts.up_proj):
                proj.weight.normal_(0.0, std)
            self.shared_experts.down_proj.weight.normal_(0.0, std if out_std is None else out_std)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.dropped_per_expert.zero_()
