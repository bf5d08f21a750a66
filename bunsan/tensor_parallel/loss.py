"""Vocabulary-parallel cross-entropy: the loss over logits split by vocabulary, never gathering them.

Each rank holds logits[..., V/tp]. With m the global max (a MAX all-reduce, a
constant for autograd), S = sum over ranks of sum exp(logit - m) (SUM all-reduce),
and t the target's logit (found on the rank that owns it, then summed):

    loss = log S + m - t

The all-reduces of S and t pass gradients straight through, so each rank gets
softmax - one_hot for its own slice of the vocabulary.
"""

from __future__ import annotations

import torch

from bunsan.tensor_parallel.ops import ReduceFromTP


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
    """Summed token cross-entropy (labels shifted, -100 ignored) from this rank's vocabulary slice."""
    ctx = head.ctx
    x = logits.float()
    local_v = x.shape[-1]
    vocab_ids = head.start + torch.arange(local_v, device=x.device)
    if head.padded != head.vocab_size:   # padding rows of the table are not words
        x = x.masked_fill(vocab_ids >= head.vocab_size, float("-inf"))
    m = x.detach().amax(dim=-1)
    ctx.comm.all_reduce(m, ctx.group, op="max")
    shifted = x - m.unsqueeze(-1)
    s = ReduceFromTP.apply(ctx, shifted.exp().sum(dim=-1))
    valid = labels != -100
    local = labels - head.start
    mine = valid & (local >= 0) & (local < local_v)
    t = torch.gather(shifted, -1, local.clamp(0, local_v - 1).unsqueeze(-1)).squeeze(-1)
    t = ReduceFromTP.apply(ctx, torch.where(mine, t, torch.zeros_like(t)))
    loss = torch.log(s) - t
    return torch.where(valid, loss, torch.zeros_like(loss)).sum()
