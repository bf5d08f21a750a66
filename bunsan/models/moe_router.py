"""Token-choice top-k routing for the MoE block (models/moe.py), and the losses that balance it.

route() turns router logits [tokens, experts] into each token's k experts and their combine weights:

  scores    softmax(logits) or sigmoid(logits), in fp32 whatever the model dtype (routing decisions are
            sensitive to rounding, and the scores weight every expert output)
  choice    scores + expert_bias: the bias (DeepSeek-V3's auxiliary-loss-free balancing) steers which
            experts are picked and nothing else; the weights below never see it
  groups    with n_groups > 1 only the topk_groups best groups stay choosable (group score: the best
            expert's choice for softmax, as DeepSeek-V2; the sum of the best two for sigmoid, as DeepSeek-V3)
  top-k     the k best choices per token
  weights   the picked experts' scores, renormalised to sum 1 over the k when route_norm, times route_scale

The balancing losses are functions of a Routing, so the block computes only the ones whose coefficient is on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bunsan.models.moe_config import MoEConfig

# Added to the sum of the k picked scores before renormalising: keeps a sum that underflowed to 0 (sigmoid
# scores of very negative logits) from giving 0/0 = NaN weights, and is far below fp32 rounding otherwise
ROUTE_NORM_EPS = 1e-20


@dataclass
class Routing:
    """One forward's routing of T tokens over E experts, k per token."""

    logits: torch.Tensor    # [T, E] fp32 router logits
    scores: torch.Tensor    # [T, E] fp32 softmax or sigmoid scores (without the bias)
    experts: torch.Tensor   # [T, k] int64: token t's experts, best choice first
    weights: torch.Tensor   # [T, k] fp32 combine weights; carry gradient to the router

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]


def router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """softmax over the experts, or an independent sigmoid per expert, in fp32."""
    if score_func == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if score_func == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"score_func {score_func!r} is not one of ('softmax', 'sigmoid')")


def limit_to_groups(choice: torch.Tensor, n_groups: int, topk_groups: int, score_func: str) -> torch.Tensor:
    """`choice` [T, E] with every expert outside each token's topk_groups best groups set to -inf.

    The groups are consecutive runs of E / n_groups experts (expert e is in group e // (E / n_groups)).
    A group scores by its best expert's choice under softmax (DeepSeek-V2), by the sum of its best two under
    sigmoid (DeepSeek-V3, where one strong expert should not carry a group alone).
    """
    if n_groups == 1 or topk_groups == n_groups:
        return choice
    t, e = choice.shape
    grouped = choice.view(t, n_groups, e // n_groups)
    if score_func == "sigmoid":
        best = min(2, e // n_groups)
        group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    kept_groups = group_scores.topk(topk_groups, dim=-1, sorted=False).indices          # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def route(logits: torch.Tensor, config: MoEConfig, expert_bias: torch.Tensor | None = None) -> Routing:
    """Each token's top_k experts and combine weights from router logits [T, E] (see the module docstring).

    expert_bias [E] shifts which experts are chosen, never the weights. Detached here: it is a buffer moved by
    `MoE.update_expert_bias`, not by gradients."""
    if logits.dim() != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(f"router logits must be [tokens, num_experts={config.num_experts}], got shape "
                         f"{tuple(logits.shape)}")
    logits = logits.float()
    scores = router_scores(logits, config.score_func)
    choice = scores.detach()
    if expert_bias is not None:
        if expert_bias.shape != (config.num_experts,):
            raise ValueError(f"expert_bias must have shape ({config.num_experts},) (one per expert), got "
                             f"{tuple(expert_bias.shape)}")
        choice = choice + expert_bias.detach().float()
    choice = limit_to_groups(choice, config.n_groups, config.topk_groups, config.score_func)
    experts = choice.topk(config.top_k, dim=-1).indices                 # sorted: best choice first
    weights = scores.gather(1, experts)
    if config.normalizes_routes:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTE_NORM_EPS)
    if config.route_scale != 1.0:
        weights = weights * config.route_scale
    return Routing(logits=logits, scores=scores, experts=experts, weights=weights)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] (int64) from the chosen experts [T, k]."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts)


def load_balancing_loss(routing: Routing, num_experts: int, score_func: str) -> torch.Tensor:
    """Switch/GShard auxiliary loss: E * sum_e f_e * P_e, a 0-dim fp32 tensor (1.0 when perfectly balanced).

    f_e: the fraction of the T * k assignments that chose expert e (a count: no gradient).
    P_e: the mean over tokens of e's router probability: the softmax scores, or for sigmoid the scores
         normalised to sum 1 per token (DeepSeek-V3's sequence-wise balance loss).
    Dividing by T * k keeps a balanced router at 1.0 for any k, as DeepSeek's form does; transformers'
    Mixtral `load_balancing_loss_func` divides f by T only, so it is top_k times this: a Mixtral
    router_aux_loss_coef carries over multiplied by top_k.
    """
    t = routing.scores.shape[0]
    if t == 0:
        return routing.scores.sum()     # 0, still attached to the router
    fraction = expert_counts(routing.experts, num_experts).float() / (t * routing.top_k)
    probs = routing.scores
    if score_func == "sigmoid":
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2, a 0-dim fp32 tensor. Keeps the
    logits small, which keeps the softmax (and bf16 routing) stable."""
    if logits.shape[0] == 0:
        return logits.float().sum()
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
