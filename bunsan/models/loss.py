"""Summed token cross-entropy that never holds fp32 logits for the whole micro-batch.

`F.cross_entropy(logits.float(), ...)` upcasts all N x V logits to fp32 and autograd keeps the fp32
log-softmax until backward: at 8 x 4096 tokens and a 128k vocabulary that is 17 GB of fp32 copy plus
17 GB saved, beside the 16-bit logits. `lm_loss_sum` walks the flattened [N, V] logits a chunk of rows
at a time instead:

  forward   per chunk: fp32 log-softmax, the target's log-probability, summed; saves only the
            logits (as they came, in the model dtype) and the labels
  backward  per chunk: the fp32 log-softmax again, exp(log p) * g, minus g at the target, 0 on
            ignored rows, cast into one gradient tensor of the logits' shape and dtype

so the only full-size tensors are the logits and their gradient, in the model dtype; the fp32 work
lives one chunk at a time. Each chunk runs the same log-softmax kernel as `F.cross_entropy` on the
same fp32 values and applies the gradient formula autograd applies (nll_loss, then log_softmax's
backward, then the cast of `.float()`), so per-row losses are the same numbers and gradients agree
to fp32 rounding; only the order of the final sum differs.

Labels outside [0, V) other than the ignore index -100 are an error, never clamped: on the CPU a
check raises ValueError; on a GPU a check would wait for the device (a host sync per micro-batch),
so there the gather itself device-asserts on an out-of-range index, as `F.cross_entropy` does.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
# fp32 elements of one chunk (256 MiB): each kernel runs long past its launch cost, while the
# transient fp32 working set (at most two such buffers: the upcast chunk and its log-softmax) stays
# far below the logits themselves.
CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (labels already shifted; -100 ignored): a 0-dim fp32 tensor.

    logits [..., V] in any float dtype (non-contiguous ones cost a transient copy per pass); labels
    of shape logits.shape[:-1], integer. chunk_rows: rows of the flattened [N, V] logits per chunk
    (default: CHUNK_ELEMENTS / V).
    """
    labels = checked_labels(logits, labels, logits.shape[-1] if logits.dim() else 0)
    chunk_rows = checked_chunk_rows(chunk_rows, logits.shape[-1])
    return _ChunkedCrossEntropySum.apply(logits, labels, chunk_rows)


def checked_labels(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """The labels flattened to int64, after the checks of lm_loss_sum's docstring. vocab: the real
    vocabulary, which the labels must fall in (under vocabulary parallelism, not the rank's slice)."""
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [..., vocab], got {logits.dtype} of shape "
                         f"{tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits have an empty vocabulary dimension")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match logits {tuple(logits.shape)}: "
                         f"expected {tuple(logits.shape[:-1])}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    labels = labels.reshape(-1).long()
    if labels.device.type == "cpu":   # free here; on a GPU it would sync, so the gather asserts instead
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bad.any():                        # host: CPU labels, nothing to wait for
            i = int(bad.nonzero()[0, 0])     # host: CPU labels, for the error
            label = int(labels[i])           # host: CPU labels, for the error
            raise ValueError(f"label {label} at flat position {i} is outside [0, {vocab}) and is not the "
                             f"ignore index {IGNORE_INDEX}")
    return labels


def checked_chunk_rows(chunk_rows: int | None, width: int) -> int:
    """chunk_rows as given (a positive int), or the default for rows of `width` logits."""
    if chunk_rows is None:
        return default_chunk_rows(width)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    return chunk_rows


def _targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept rows, gather index): ignored rows gather column 0 and are then zeroed; no other label is
    touched, so an out-of-range one still fails in the gather."""
    keep = labels != IGNORE_INDEX
    return keep, torch.where(keep, labels, 0).unsqueeze(1)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, chunk_rows):
        flat = logits.reshape(-1, logits.shape[-1])   # a view unless the logits are non-contiguous
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, flat.shape[0], chunk_rows):
            keep, index = _targets(labels[start:start + chunk_rows])
            logp = torch.log_softmax(flat[start:start + chunk_rows].float(), dim=-1)
            picked = logp.gather(1, index).squeeze(1)
            total += torch.where(keep, -picked, 0.0).sum()
            del logp                        # before the next chunk's buffers: one chunk's alive at a time
        ctx.save_for_backward(logits, labels)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        logits, labels = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad.view(-1, logits.shape[-1])
        g = grad_total.float()
        for start in range(0, flat.shape[0], ctx.chunk_rows):
            end = start + ctx.chunk_rows
            keep, index = _targets(labels[start:end])
            g_row = torch.where(keep, g, 0.0).unsqueeze(1)      # d(sum)/d(-log p[target]) per row
            # fp32 logits: work in the gradient's own rows; 16-bit: in an fp32 chunk, then cast
            out = grad_flat[start:end] if grad.dtype == torch.float32 else None
            work = torch.log_softmax(flat[start:end].float(), dim=-1, out=out)
            # log_softmax's backward of nll's gradient (-g at the target): exp(log p) * g - g at the target
            work.exp_().mul_(g_row).scatter_add_(1, index, -g_row)
            if out is None:
                grad_flat[start:end].copy_(work)                 # the cast `.float()`'s backward makes
            del work
        return grad, None, None
