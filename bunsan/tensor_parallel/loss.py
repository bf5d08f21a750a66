"""Vocabulary-parallel cross-entropy: the loss over logits split by vocabulary, never gathered, never fp32 whole.

Each rank holds logits[..., V/tp]. With m the global row max (a MAX all-reduce), S = sum over ranks of
sum exp(logit - m) (a SUM all-reduce) and t = logit[target] - m (found on the rank that owns the target,
then summed):

    loss = sum over kept rows of  log S - t

Upcasting the rank's whole [N, V/tp] slice to fp32 and letting autograd keep exp(logit - m) would hold
two fp32 copies of it from forward to backward. `vocab_parallel_loss_sum` walks it a chunk of rows at a
time instead, as `bunsan.models.loss.lm_loss_sum` does without tensor parallelism:

  forward   the row max of the slice in the logits' own dtype (a max is exact in any dtype): [N], one
            MAX all-reduce; then per chunk: logit - m in fp32, the target's term on the owning rank, exp,
            the row sum; then one SUM all-reduce each of the sums [N] and the targets [N]. Saves only the
            logits (as they came, in the model dtype), the labels, and m and S (fp32 [N]).
  backward  per chunk: exp(logit - m) * g / S, minus g at the target on the owning rank, 0 on ignored
            rows and on padding columns, cast into one gradient tensor of the logits' shape and dtype. No
            communication: each rank's gradient is its own slice of softmax - one_hot.

So the fp32 work lives one chunk at a time, and there are three [N] all-reduces per micro-batch however
many chunks there are. The chunks run the same fp32 operations as the unchunked formula (logit - m, exp,
the row sum; (g / S) * exp(logit - m) and the one-hot added after, which is what autograd computes through
it), which is why S rather than log S is kept: losses agree to the order of a sum, gradients to fp32
rounding.

Padding of the table (head.padded > head.vocab_size) sits at the end of the last ranks' slices, so those
columns are cut off rather than masked: they take no part in the max or the sum and get a zero gradient.
Labels follow lm_loss_sum's rules: outside [0, vocab_size) and not -100 is a ValueError on the CPU; on a
GPU such a row gathers one column past the slice, so the gather device-asserts instead of clamping.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from bunsan.models.loss import IGNORE_INDEX, checked_chunk_rows, checked_labels


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, head,
                            chunk_rows: int | None = None) -> torch.Tensor:
    """Summed token cross-entropy (labels shifted, -100 ignored) from this rank's vocabulary slice.

    logits [..., padded/tp] from `head` (a VocabParallelHead), any float dtype; labels of shape
    logits.shape[:-1], token ids of the whole vocabulary. A 0-dim fp32 tensor, the same on every rank.
    chunk_rows: rows of the flattened [N, padded/tp] slice per chunk (default: CHUNK_ELEMENTS / (padded/tp)).
    """
    tp = head.ctx
    width = head.padded // tp.size
    if logits.dim() < 1 or logits.shape[-1] != width:
        raise ValueError(f"logits of shape {tuple(logits.shape)} are not this rank's vocabulary slice: expected "
                         f"[..., {width}] (vocabulary {head.vocab_size} padded to {head.padded}, over {tp.size} "
                         f"ranks)")
    labels = checked_labels(logits, labels, head.vocab_size)
    chunk_rows = checked_chunk_rows(chunk_rows, width)
    real = min(width, max(0, head.vocab_size - head.start))   # columns before the padding
    return _VocabParallelCrossEntropySum.apply(logits, labels, tp, head.start, real, head.vocab_size, chunk_rows)


def _targets(labels: torch.Tensor, start: int, real: int, vocab: int):
    """(kept rows, rows whose target is on this rank, gather index into the rank's real columns).

    Rows whose target is elsewhere (or ignored) gather column 0 and are then zeroed; a label outside
    [0, vocab) gathers column `real`, one past the slice, so that it fails in the gather."""
    keep = labels != IGNORE_INDEX
    local = labels - start
    mine = keep & (local >= 0) & (local < real)
    bad = keep & ((labels < 0) | (labels >= vocab))
    index = torch.where(mine, local, torch.where(bad, real, 0))
    return keep, mine, index.unsqueeze(1)


def _row_max(flat: torch.Tensor, real: int) -> torch.Tensor:
    """fp32 [N]: the max of each row's real columns (-inf where a rank holds only padding)."""
    if real == 0:
        return torch.full(flat.shape[:1], float("-inf"), dtype=torch.float32, device=flat.device)
    return flat[:, :real].amax(dim=-1).float()


class _VocabParallelCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp, start, real, vocab, chunk_rows):
        flat = logits.reshape(-1, logits.shape[-1])   # a view unless the logits are non-contiguous
        rows = flat.shape[0]
        m = _row_max(flat, real)
        tp.comm.all_reduce(m, tp.group, op="max")
        sums = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        targets = torch.zeros(rows, dtype=torch.float32, device=logits.device)
        for lo in range(0, rows if real else 0, chunk_rows):   # a rank of padding only adds nothing
            hi = lo + chunk_rows
            _, mine, index = _targets(labels[lo:hi], start, real, vocab)
            # fp32 by promotion against m: one fp32 buffer per chunk, for 16-bit and fp32 logits alike
            work = torch.sub(flat[lo:hi, :real], m[lo:hi].unsqueeze(1))
            targets[lo:hi] = torch.where(mine, work.gather(1, index).squeeze(1), 0.0)
            sums[lo:hi] = work.exp_().sum(dim=-1)
            del work                          # before the next chunk's buffer: one alive at a time
        tp.comm.all_reduce(sums, tp.group, op="sum")
        tp.comm.all_reduce(targets, tp.group, op="sum")
        total = torch.where(labels != IGNORE_INDEX, sums.log() - targets, 0.0).sum()
        ctx.save_for_backward(logits, labels, m, sums)
        ctx.layout = (start, real, vocab, chunk_rows)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        logits, labels, m, sums = ctx.saved_tensors
        start, real, vocab, chunk_rows = ctx.layout
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(-1, logits.shape[-1])
        grad_flat[:, real:].zero_()                   # padding columns are not words
        g = grad_total.float()
        for lo in range(0, flat.shape[0] if real else 0, chunk_rows):
            hi = lo + chunk_rows
            keep, mine, index = _targets(labels[lo:hi], start, real, vocab)
            g_row = torch.where(keep, g, 0.0)                    # d(sum)/d(loss) per row
            # fp32 logits: work in the gradient's own rows; 16-bit: in an fp32 chunk, then cast
            out = grad_flat[lo:hi, :real] if grad.dtype == torch.float32 else None
            work = torch.sub(flat[lo:hi, :real], m[lo:hi].unsqueeze(1), out=out)
            # d log S = g / S, through exp: (g / S) * exp(logit - m); d(-t) = -g at the target, where owned
            work.exp_().mul_((g_row / sums[lo:hi]).unsqueeze(1))
            work.scatter_add_(1, index, torch.where(mine, -g_row, 0.0).unsqueeze(1))
            if out is None:
                grad_flat[lo:hi, :real].copy_(work)               # the cast an fp32 upcast's backward makes
            del work
        return grad, None, None, None, None, None, None
