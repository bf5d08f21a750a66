"""The gate of `deepspeed.moe.layer.MoE`, with DeepSpeed's routing semantics (GShard's top-1/top-2 and top-k):

    scores     softmax of the fp32 logits x @ wg^T (input jittered by x U(1-eps, 1+eps) under "Jitter")
    top-1      the argmax expert (of logits + Gumbel noise under "RSample"); capacity max(ceil(S/E * cf),
               min_capacity); an expert over it keeps `capacity` of its tokens chosen at random (random
               token selection, use_rts) or by torch.topk's order; weight = the expert's score
    top-2      the argmax, then the argmax of the others (of logits + Gumbel noise, by default); capacity
               from 2 * cf; every token's first choice ranks before any second choice; the kept weights
               renormalised to sum 1
    top-k      the k best scores; capacity from k * cf, the highest-weighted assignments kept per expert;
               weights renormalised
    dropless   drop_tokens False: capacity = the busiest expert's count (the max over the expert-parallel
               group, so every rank's buffer has one size)

Each returns a `Routes`: per route (k of them) and token, the expert (-1: dropped), its slot in that expert's
capacity buffer and its weight; the auxiliary loss and the tokens per expert before any drop. The noise is
drawn with torch.distributions in the order DeepSpeed draws it, so a run seeded alike draws the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NOISE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routes:
    l_aux: torch.Tensor        # 0-dim fp32, attached to the gate
    capacity: int              # slots per expert in the dispatch buffer
    experts: torch.Tensor      # [k, S] int64: each route's expert, -1 where dropped
    slots: torch.Tensor        # [k, S] int64: its position in the expert's buffer (0 where dropped)
    weights: torch.Tensor      # [k, S] fp32: its combine weight (0 where dropped), carries the gate's gradient
    exp_counts: torch.Tensor   # [E] int64: tokens per expert, before capacity


def _gumbel(shape, device) -> torch.Tensor:
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)   # host: noise set-up
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape, low: float, high: float, device) -> torch.Tensor:
    lo, hi = torch.tensor(low, device=device), torch.tensor(high, device=device)     # host: noise set-up
    return torch.distributions.uniform.Uniform(lo, hi).rsample(shape)


def jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """x times noise uniform in [1 - epsilon, 1 + epsilon] (the "Jitter" policy, on the gate's input)."""
    return x * _uniform(x.shape, 1.0 - epsilon, 1.0 + epsilon, x.device)


def capacity_for(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(tokens / experts * factor), int(min_capacity))


def dropless_capacity(exp_counts: torch.Tensor, tokens: int, max_over_group) -> int:
    """The busiest expert's count, made the same on every rank of the expert-parallel group."""
    busiest = exp_counts.max().reshape(1)
    max_over_group(busiest)
    return min(int(busiest.item()), tokens)    # host: the buffer's size


def top1(logits: torch.Tensor, factor: float, min_capacity: int, used_token, noise: str | None,
         drop_tokens: bool, use_rts: bool, max_over_group) -> Routes:
    scores = F.softmax(logits, dim=1)
    tokens, num_experts = scores.shape
    capacity = capacity_for(tokens, num_experts, factor, min_capacity)
    choice = logits + _gumbel(logits.shape, logits.device) if noise == "RSample" else scores
    best = choice.argmax(dim=1)
    mask = F.one_hot(best, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = dropless_capacity(exp_counts, tokens, max_over_group)
    l_aux = (scores.mean(dim=0) * mask.float().mean(dim=0)).sum() * num_experts
    priority = mask * _uniform(mask.shape, 0.0, 1.0, logits.device) if use_rts else mask
    if tokens < min_capacity:
        raise ValueError(f"MoE got {tokens} tokens, fewer than min_capacity {min_capacity}: set min_capacity "
                         "to 0 or feed more tokens per micro-batch (DeepSpeed's rule)")
    chosen = torch.topk(priority, k=min(capacity, tokens), dim=0).indices
    mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
    kept = mask.sum(dim=1)
    experts = torch.where(kept > 0, best, torch.full_like(best, -1))
    slots = ((mask.cumsum(dim=0) - 1) * mask).sum(dim=1)
    weights = (scores * mask).sum(dim=1)
    return Routes(l_aux, capacity, experts.unsqueeze(0), slots.unsqueeze(0), weights.unsqueeze(0), exp_counts)


def top2(logits: torch.Tensor, factor: float, min_capacity: int, drop_tokens: bool, sample_second: bool,
         max_over_group) -> Routes:
    scores = F.softmax(logits, dim=1)
    tokens, num_experts = scores.shape
    first = scores.argmax(dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if sample_second:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = logits.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    slots1 = mask1.cumsum(dim=0) - 1
    slots2 = mask2.cumsum(dim=0) - 1 + mask1.sum(dim=0, keepdim=True)    # second choices after every first
    l_aux = (scores.mean(dim=0) * mask1.float().mean(dim=0)).mean() * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = capacity_for(tokens, num_experts, 2 * factor, min_capacity)
        mask1 = mask1 * (slots1 < capacity)
        mask2 = mask2 * (slots2 < capacity)
    else:
        capacity = dropless_capacity(exp_counts, tokens, max_over_group)
    w1, w2 = (scores * mask1).sum(dim=1), (scores * mask2).sum(dim=1)
    total = (w1 + w2).clamp(min=torch.finfo(scores.dtype).eps)
    experts = torch.stack([torch.where(mask1.any(dim=1), first, -1), torch.where(mask2.any(dim=1), second, -1)])
    slots = torch.stack([(slots1 * mask1).sum(dim=1), (slots2 * mask2).sum(dim=1)])
    return Routes(l_aux, capacity, experts, slots, torch.stack([w1 / total, w2 / total]), exp_counts)


def topk(logits: torch.Tensor, k: int, factor: float, min_capacity: int, drop_tokens: bool,
         max_over_group) -> Routes:
    scores = F.softmax(logits, dim=1)
    tokens, num_experts = scores.shape
    best_scores, best = torch.topk(scores, k=k, dim=1)
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = (scores.mean(dim=0) * mask.float().mean(dim=0)).mean() * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_for(tokens, num_experts, k * factor, min_capacity)
        masked = torch.zeros_like(scores).scatter(1, best, best_scores)
        keep = torch.topk(masked, k=min(capacity, tokens), dim=0, sorted=False).indices
        mask = mask & torch.zeros_like(mask).scatter_(0, keep, True)
    else:
        capacity = dropless_capacity(exp_counts, tokens, max_over_group)
    positions = mask.long().cumsum(dim=0) - 1
    kept_scores = scores * mask
    kept_scores = kept_scores / kept_scores.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).eps)
    kept = mask.gather(1, best)
    experts = torch.where(kept, best, torch.full_like(best, -1)).t()
    slots = (positions.gather(1, best) * kept).t()
    return Routes(l_aux, capacity, experts, slots, kept_scores.gather(1, best).t(), exp_counts)
