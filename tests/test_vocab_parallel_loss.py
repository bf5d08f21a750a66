"""The chunked vocabulary-parallel loss against the unchunked formula and F.cross_entropy, what it saves and
what it holds, on 2 spawned gloo ranks (and one, for the checks made before any communication)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bunsan.estimator.activations import Micro, loss_bytes
from bunsan.models.presets import build_config
from bunsan.tensor_parallel import vocab_parallel_loss_sum
from bunsan.tensor_parallel.ops import ReduceFromTP
from live_bytes import LiveBytes

V = 97          # prime: over 2 ranks the table pads to 98, and rank 1 holds one padding column
SHAPE = (3, 41)  # 123 rows: no chunk size here divides them evenly by accident
TP = 2


def _head(vocab: int, tp: int = TP):
    from bunsan.comm.collectives import Comm
    from bunsan.comm.mesh import Mesh
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel import TPContext
    from bunsan.tensor_parallel.layers import VocabParallelHead
    if tp == 1:
        ctx = TPContext(Comm(), Group("tp", None, 1, 0, (0,)))
    else:
        ctx = TPContext(Comm(timeout_s=60), Mesh.create(tp=tp).tp_group)
    return VocabParallelHead(nn.Linear(4, vocab, bias=False), ctx)


def _batch(vocab, dtype, shape=SHAPE, ignored=0.2, seed=0, tp=TP):
    """Whole logits [*shape, padded] (junk in the padding columns: large, so counting them would show) and
    labels with some -100."""
    g = torch.Generator().manual_seed(seed)
    padded = -(-vocab // tp) * tp
    logits = 4 * torch.randn(*shape, padded, generator=g)
    logits[..., vocab:] = 50.0
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignored] = -100
    return logits.to(dtype), labels


def _unchunked(logits, labels, head):
    """The formula before chunking (the whole slice in fp32, autograd keeping exp and the shifted logits)."""
    ctx = head.ctx
    x = logits.float()
    vocab_ids = head.start + torch.arange(x.shape[-1])
    x = x.masked_fill(vocab_ids >= head.vocab_size, float("-inf"))
    m = x.detach().amax(dim=-1)
    ctx.comm.all_reduce(m, ctx.group, op="max")
    shifted = x - m.unsqueeze(-1)
    s = ReduceFromTP.apply(ctx, shifted.exp().sum(dim=-1))
    valid = labels != -100
    local = labels - head.start
    mine = valid & (local >= 0) & (local < x.shape[-1])
    t = torch.gather(shifted, -1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    t = ReduceFromTP.apply(ctx, torch.where(mine, t, torch.zeros_like(t)))
    return torch.where(valid, torch.log(s) - t, torch.zeros_like(s)).sum()


def _loss_and_grad(fn, local, labels, scale):
    x = local.detach().clone().requires_grad_()
    loss = fn(x, labels)
    (loss * scale).backward()
    return loss.detach(), x.grad


def _parity(rank, vocab, dtype, chunks, scale):
    """This rank's (loss, gradient) of the chunked loss per chunk size, of the unchunked formula, and of
    F.cross_entropy on the whole real vocabulary (its gradient cut to this rank's slice, padding zero)."""
    head = _head(vocab)
    full, labels = _batch(vocab, dtype)
    width = head.padded // TP
    local = full[..., head.start:head.start + width]
    ours = {c: _loss_and_grad(lambda x, y, c=c: vocab_parallel_loss_sum(x, y, head, c), local, labels, scale)
            for c in chunks}
    # non-contiguous logits (not viewable as [-1, width]): the loss reshapes a copy per pass
    strided = lambda x, y: vocab_parallel_loss_sum(x.transpose(0, 1), y.transpose(0, 1), head, 7)  # noqa: E731
    ours["strided"] = _loss_and_grad(strided, local, labels, scale)
    unchunked = _loss_and_grad(lambda x, y: _unchunked(x, y, head), local, labels, scale)
    ce = lambda x, y: F.cross_entropy(x.float()[..., :vocab].reshape(-1, vocab), y.reshape(-1),  # noqa: E731
                                      ignore_index=-100, reduction="sum")
    ref_loss, ref_grad = _loss_and_grad(ce, full, labels, scale)
    return ours, unchunked, (ref_loss, ref_grad[..., head.start:head.start + width])


CHUNKS = [None, 1, 7, 40, 122, 123, 1000]


@pytest.fixture(scope="module")
def fp32_runs(pools):
    return pools.run(TP, _parity, V, torch.float32, CHUNKS, 0.37)


@pytest.mark.parametrize("chunk_rows", CHUNKS + ["strided"])

def test_fp32_matches_the_unchunked_formula_and_cross_entropy(fp32_runs, chunk_rows):
    for ours, (old_loss, old_grad), (ref_loss, ref_grad) in fp32_runs:
        loss, grad = ours[chunk_rows]
        assert loss.dtype == torch.float32 and loss.shape == () and grad.dtype == torch.float32
        torch.testing.assert_close(loss, old_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, old_grad, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)
    assert torch.equal(fp32_runs[1][0][chunk_rows][1][..., -1], torch.zeros(SHAPE))   # the padding column
    assert fp32_runs[0][0][chunk_rows][0] == fp32_runs[1][0][chunk_rows][0]          # one loss on every rank


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (bit patterns as ordered integers, signs handled)."""
    def ordered(t):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return (ordered(a) - ordered(b)).abs()


def test_bf16_gradient_is_the_same_bf16_values(pools):
    for ours, (old_loss, old_grad), (ref_loss, ref_grad) in pools.run(TP, _parity, V, torch.bfloat16,
                                                                       [None, 5, 64], 1 / 200):
        for loss, grad in ours.values():
            # The loss is fp32 from exactly upcast logits: the same as both references to the order of a sum.
            torch.testing.assert_close(loss, old_loss, rtol=1e-6, atol=0)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
            assert grad.dtype == torch.bfloat16
            # The fp32 gradients agree to fp32 rounding, but a value that straddles a bf16 rounding boundary
            # rounds to the neighbouring bf16 number: one ulp at most, and rarely. Against the unchunked
            # formula (the same fp32 operations) they are the same bits.
            assert torch.equal(grad, old_grad)
            ulps = _ulps(grad, ref_grad)
            assert int(ulps.max()) <= 1
            assert int((ulps > 0).sum()) <= grad.numel() // 1000


def _all_ignored_and_padding_only(rank):
    """A rank holding nothing but padding (vocabulary 1 over 2 ranks), and a batch of ignored labels."""
    head = _head(1)
    full, labels = _batch(1, torch.float32)
    one = _loss_and_grad(lambda x, y: vocab_parallel_loss_sum(x, y, head, 10), full[..., rank:rank + 1],
                         labels, 1.0)
    head = _head(V)
    full, labels = _batch(V, torch.bfloat16, ignored=1.0)
    width = head.padded // TP
    none = _loss_and_grad(lambda x, y: vocab_parallel_loss_sum(x, y, head, 16),
                          full[..., head.start:head.start + width], labels, 1.0)
    return one, none


def test_all_ignored_and_a_rank_of_padding_only(pools):
    for rank, (one, none) in enumerate(pools.run(TP, _all_ignored_and_padding_only)):
        assert one[0].item() == 0.0 and torch.equal(one[1], torch.zeros_like(one[1]))   # log softmax of one word
        assert none[0].item() == 0.0 and torch.equal(none[1], torch.zeros_like(none[1]))
        assert none[1].dtype == torch.bfloat16


def _memory(rank, fn_name, vocab, dtype, shape, chunk_rows):
    """(saved tensors as (dtype, shape), peak live bytes in forward, in backward less the gradient, the
    gradient's bytes)."""
    head = _head(vocab)
    full, labels = _batch(vocab, dtype, shape=shape)
    width = head.padded // TP
    x = full[..., head.start:head.start + width].clone().requires_grad_()
    fn = (lambda: vocab_parallel_loss_sum(x, labels, head, chunk_rows)) if fn_name == "chunked" \
        else (lambda: _unchunked(x, labels, head))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, tuple(t.shape))) or t,
                                                  lambda t: t):
        with LiveBytes() as forward:
            loss = fn()
    with LiveBytes() as backward:
        loss.backward()
    grad_bytes = x.grad.numel() * x.grad.element_size()
    return saved, forward.peak, backward.peak - grad_bytes, grad_bytes


MEM = dict(vocab=2001, shape=(2, 256), chunk_rows=64)   # 512 rows over a 1001-wide slice, 8 chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_no_fp32_slice_and_holds_one_chunk(pools, dtype):
    rows, width = 512, 1001
    slice_fp32 = 4 * rows * width
    chunk_fp32 = 4 * MEM["chunk_rows"] * width
    small = 64 * rows                   # a few [rows] vectors (max, sums, targets, their collectives)
    runs = pools.run(TP, _memory, "chunked", MEM["vocab"], dtype, MEM["shape"], MEM["chunk_rows"])
    for rank, (saved, forward, backward, grad_bytes) in enumerate(runs):
        # the logits (as they came), the labels, and the fp32 max and sum of each row
        assert sorted(saved, key=str) == sorted([(dtype, (2, 256, width)), (torch.int64, (rows,)),
                                                 (torch.float32, (rows,)), (torch.float32, (rows,))], key=str)
        # forward: one chunk's fp32 work; backward: the gradient (whole, model dtype) and, in 16-bit, one
        # chunk's fp32 work (fp32 logits work in the gradient's own rows)
        assert chunk_fp32 <= forward <= chunk_fp32 + small, (rank, forward, chunk_fp32)
        assert grad_bytes == dtype.itemsize * rows * width
        extra = chunk_fp32 if dtype == torch.bfloat16 else 0
        assert extra <= backward <= extra + small, (rank, backward, chunk_fp32)
    runs = pools.run(TP, _memory, "unchunked", MEM["vocab"], dtype, MEM["shape"], MEM["chunk_rows"])
    for saved, forward, backward, _ in runs:
        assert any(dt == torch.float32 and len(s) == 3 and s[-1] == width for dt, s in saved)
        assert forward >= 2 * slice_fp32 and backward >= 2 * slice_fp32   # what the chunks save


def test_estimator_prices_what_it_saves_and_holds(pools):
    """loss_bytes at tp 2 against the measured saved bytes and the forward and backward peaks."""
    cfg = build_config("tiny", vocab_size=MEM["vocab"])
    b, s = MEM["shape"]
    for dtype in (torch.float32, torch.bfloat16):
        kept, transient = loss_bytes(cfg, Micro(b, s, dtype.itemsize, tp=TP, device="cpu"))
        for saved, forward, backward, grad_bytes in pools.run(TP, _memory, "chunked", MEM["vocab"], dtype,
                                                               MEM["shape"], None):
            saved_bytes = sum(dt.itemsize * torch.Size(sh).numel() for dt, sh in saved if dt != torch.int64)
            assert saved_bytes == kept   # the labels: the token ids the embedding keeps anyway
            assert max(forward, backward + grad_bytes) == pytest.approx(transient, rel=0.05)


def _errors(rank):
    head = _head(V, tp=1)
    full, labels = _batch(V, torch.float32, tp=1)
    out = []
    for bad in (V, V + 5, -1, -101):
        wrong = labels.clone()
        wrong[1, 3] = bad
        with pytest.raises(ValueError, match=f"label {bad} at flat position {41 + 3} is outside \\[0, {V}\\)"):
            vocab_parallel_loss_sum(full, wrong, head)
        out.append(bad)
    with pytest.raises(ValueError, match="not this rank's vocabulary slice"):
        vocab_parallel_loss_sum(full[..., :-1], labels, head)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        vocab_parallel_loss_sum(full, labels, head, 0)
    return out


def test_out_of_range_labels_raise_before_any_collective():
    assert _errors(0) == [V, V + 5, -1, -101]


def _padded_label(rank):
    """A label in the padding [vocab, padded) is no word: an error, though the last rank holds its column."""
    head = _head(V)
    full, labels = _batch(V, torch.float32)
    labels[0, 0] = V       # 97: rank 1's padding column
    width = head.padded // TP
    with pytest.raises(ValueError, match=f"label {V} at flat position 0"):
        vocab_parallel_loss_sum(full[..., head.start:head.start + width], labels, head)
    return True


def test_a_padding_label_is_an_error_on_every_rank(pools):
    assert pools.run(TP, _padded_label) == [True, True]
