"""bunsan.lm_loss: the chunked cross-entropy against F.cross_entropy(logits.float()), and what it saves."""

import pytest
import torch
import torch.nn.functional as F

from bunsan.models import loss as lm_loss
from bunsan.models.loss import default_chunk_rows, lm_loss_sum

V = 97   # prime: no chunk size divides the rows evenly by accident


def _reference(logits, labels, scale):
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.float().reshape(-1, x.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")
    (loss * scale).backward()
    return loss.detach(), x.grad


def _ours(logits, labels, scale, chunk_rows):
    x = logits.detach().clone().requires_grad_()
    loss = lm_loss_sum(x, labels, chunk_rows)
    (loss * scale).backward()
    return loss.detach(), x.grad


def _batch(dtype, shape=(3, 41), ignored=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(*shape, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignored] = -100
    return logits, labels


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (bit patterns as ordered integers, signs handled)."""
    def ordered(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return (ordered(a) - ordered(b)).abs()


@pytest.mark.parametrize("chunk_rows", [None, 1, 7, 40, 122, 123, 1000])
def test_fp32_loss_and_gradient_match_cross_entropy(chunk_rows):
    logits, labels = _batch(torch.float32)   # 123 rows: 7 and 40 leave a partial last chunk
    ref_loss, ref_grad = _reference(logits, labels, 0.37)
    loss, grad = _ours(logits, labels, 0.37, chunk_rows)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad.dtype == torch.float32 and grad.shape == logits.shape
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("chunk_rows", [None, 5, 64])
def test_bf16_gradient_is_the_same_bf16_values(chunk_rows):
    logits, labels = _batch(torch.bfloat16, shape=(4, 64))
    ref_loss, ref_grad = _reference(logits, labels, 1 / 200)
    loss, grad = _ours(logits, labels, 1 / 200, chunk_rows)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grad.dtype == torch.bfloat16
    ulps = _ulps(grad, ref_grad)
    # Where autograd and the chunks round in a different order the fp32 values may straddle a bf16
    # rounding boundary: one ulp at most, and rarely.
    assert int(ulps.max()) <= 1
    assert int((ulps > 0).sum()) <= grad.numel() // 1000


def test_all_ignored_gives_zero_loss_and_zero_gradient():
    logits, labels = _batch(torch.bfloat16, ignored=1.0)
    assert torch.all(labels == -100)
    loss, grad = _ours(logits, labels, 1.0, 16)
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    assert torch.equal(grad, torch.zeros_like(grad))


def test_non_contiguous_logits_and_any_leading_shape():
    full, labels = _batch(torch.float32, shape=(2, 3, 11))
    logits = full[:, :, 1:]                              # [2, 3, 10, V], not viewable as [-1, V]
    labels = labels[:, :, :-1]
    assert not logits.is_contiguous()
    ref_loss, ref_grad = _reference(logits, labels, 1.0)
    loss, grad = _ours(logits, labels, 1.0, 9)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)


def test_empty_batch():
    loss, grad = _ours(torch.zeros(0, V), torch.zeros(0, dtype=torch.long), 1.0, None)
    assert loss.item() == 0.0 and grad.shape == (0, V)


@pytest.mark.parametrize("bad", [V, V + 5, -1, -99, -101])
def test_out_of_range_labels_raise(bad):
    logits, labels = _batch(torch.float32)
    labels[1, 3] = bad
    with pytest.raises(ValueError, match=f"label {bad} at flat position {41 + 3} is outside \\[0, {V}\\)"):
        lm_loss_sum(logits, labels)


def test_clear_errors():
    logits, labels = _batch(torch.float32)
    with pytest.raises(ValueError, match="do not match logits"):
        lm_loss_sum(logits, labels[:, :-1])
    with pytest.raises(ValueError, match="integer token ids"):
        lm_loss_sum(logits, labels.float())
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        lm_loss_sum(logits, labels, 0)
    with pytest.raises(ValueError, match="float tensor"):
        lm_loss_sum(labels, labels[..., 0])


def test_default_chunk_bounds_the_fp32_working_set():
    assert default_chunk_rows(128256) == lm_loss.CHUNK_ELEMENTS // 128256
    assert default_chunk_rows(128256) * 128256 <= lm_loss.CHUNK_ELEMENTS
    assert default_chunk_rows(lm_loss.CHUNK_ELEMENTS * 2) == 1


def _saved(fn, logits, labels):
    """(dtype, numel) of every tensor autograd saves while fn runs, and whether it is the logits' storage."""
    seen = []

    def pack(t):
        seen.append((t.dtype, t.numel(), t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, labels)
    return seen


def test_saves_no_fp32_copy_of_the_logits():
    logits, labels = _batch(torch.bfloat16)
    logits.requires_grad_()
    n = logits.numel()
    plain = _saved(lambda x, y: F.cross_entropy(x.float().reshape(-1, V), y.reshape(-1), reduction="sum"),
                   logits, labels)
    assert any(dt == torch.float32 and k >= n for dt, k, _ in plain)   # the check sees the fp32 log-softmax
    ours = _saved(lm_loss_sum, logits, labels)
    assert not any(dt == torch.float32 and k >= n for dt, k, _ in ours)
    big = [(dt, k, same) for dt, k, same in ours if k >= n]
    assert big == [(torch.bfloat16, n, True)]   # the logits themselves, as they came
    assert sum(k for _, k, _ in ours) == n + labels.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_holds_one_chunk_of_fp32_work_at_a_time(dtype):
    """One chunk's fp32 work at a time, as the estimator prices it: in 16-bit the upcast and the log-softmax,
    forward and backward; in fp32 the log-softmax in forward, and in backward nothing beyond the gradient
    (its own rows are the work)."""
    from live_bytes import LiveBytes
    rows, chunk_rows, vocab = 512, 64, 2001
    x = torch.randn(rows, vocab).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,))
    with LiveBytes() as forward:
        loss = lm_loss_sum(x, labels, chunk_rows)
    with LiveBytes() as backward:
        loss.backward()
    chunk, small = 4 * chunk_rows * vocab, 64 * rows        # small: a few [rows] vectors
    fwd_buffers, bwd_buffers = (2, 2) if dtype == torch.bfloat16 else (1, 0)
    assert fwd_buffers * chunk <= forward.peak <= fwd_buffers * chunk + small
    extra = backward.peak - x.grad.numel() * x.grad.element_size()
    assert bwd_buffers * chunk <= extra <= bwd_buffers * chunk + small
