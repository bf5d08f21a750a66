"""What the step does for a model's mixture-of-experts blocks (models/moe.py), around the strategy's step.

    before the micro-batches   each block's `aux_grad_scale`: the balancing losses (auxiliary, z) enter the
                               gradient as `mean over micro-batches and data-parallel replicas of sum_blocks
                               coef * loss` would, in the units of the engine's loss (fp16's loss scale and
                               the data-parallel reduction included). The block attaches them to its output's
                               backward (Megatron's way), so a pipeline stage that never sees the loss, and a
                               recomputed block, train them alike.
    after an applied step      DeepSeek-V3's expert-bias update, from the step's token counts summed over the
                               gradient group (every replica moves its bias alike), for blocks that use it
    metrics                    per block, the routed load: the busiest expert's share of the assignments over
                               the mean share (1.0: balanced) and the fraction dropped for capacity; from
                               shares, which a block recomputed by activation checkpointing (counted twice)
                               leaves unchanged, as it leaves the sign in the bias update

The reported training loss stays the language-model loss; the balancing losses are reported beside it.
"""
from __future__ import annotations

import torch
from torch import nn

from bunsan.comm.collectives import Comm, Group
from bunsan.models.moe import MoE


class MoESteps:
    """The MoE blocks of `model` (none: every method does nothing) and the group their counts sum over."""

    def __init__(self, model: nn.Module, comm: Comm, grad_group: Group):
        self.blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
        self.comm, self.group = comm, grad_group
        self.last: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def set_aux_scale(self, scale: float) -> None:
        """The gradient each block's balancing losses get per forward (see the module docstring)."""
        for _, block in self.blocks:
            block.aux_grad_scale = scale

    @torch.no_grad()
    def after_step(self, applied: bool) -> None:
        """Read the step's counts (summed over the gradient group); move the expert biases if the step was
        applied; keep the load figures for `metrics`. Collective over the gradient group."""
        if not self.blocks:
            return
        taken = [b.take_expert_counts() for _, b in self.blocks]
        counts = torch.stack([torch.stack([t["tokens"], t["dropped"]]) for t in taken])     # [blocks, 2, E]
        self.comm.all_reduce(counts, self.group)
        losses = [b.aux_loss.detach().reshape(1).float() for _, b in self.blocks]
        figures = {}
        for (name, block), c, loss in zip(self.blocks, counts, losses):
            tokens, dropped = c[0].double(), c[1].double()
            total = tokens.sum().clamp(min=1.0)
            figures[f"moe/{name}/load_max_over_mean"] = tokens.max() * tokens.numel() / total
            figures[f"moe/{name}/dropped_fraction"] = dropped.sum() / total
            if applied and block.config.expert_bias_update_rate:
                block.update_expert_bias(c[0])
        names = list(figures)
        values = torch.stack([figures[k].reshape(()) for k in names]).tolist()   # host: metrics, after the step
        self.last = dict(zip(names, values))
        if any(b.config.aux_loss_coef or b.config.z_loss_coef for _, b in self.blocks):
            self.last["moe/balancing_loss_last_micro_batch"] = float(torch.cat(losses).sum())  # host: metrics

    def metrics(self) -> dict[str, float]:
        """The last step's load figures (see the module docstring)."""
        return dict(self.last)
