"""`bunsan serve`'s paged KV cache: the block pool and its prefix cache (blocks.py), and the batcher over it
(batcher.py) giving bunsan generate's greedy tokens whatever the pool's size: blocks taken from the prefix
cache, prompts prefilled in chunks, sequences preempted and prefilled again when the pool runs out, and as
many sequences at once as their real lengths allow."""

from __future__ import annotations

import pytest
import torch

from parity import tiny_model
from serve_harness import run_until_done


@pytest.fixture(scope="module")
def model():
    return tiny_model(0).eval()


def test_blocks_are_counted_cached_exactly_and_reused_least_recent_first():
    from bunsan.serve.blocks import BlockPool
    pool = BlockPool(5, 2)
    assert pool.usable == 4 and pool.available() == 4
    a, b = pool.allocate(), pool.allocate()
    assert 0 not in (a, b)                                    # block 0 takes padding writes: never handed out
    first = pool.register(a, 0, [1, 2])
    pool.register(b, first, [3, 4])
    pool.release([a, b])
    assert pool.available() == 4
    assert pool.cached_prefix([1, 2, 3, 4, 5], 5) == ([a, b], pool.cached[(first, (3, 4))][1])
    assert pool.available() == 2                              # taken again: held, not free
    pool.release([a, b])
    assert pool.cached_prefix([9, 2, 3, 4], 4) == ([], 0)     # the same second block after another first: no
    assert pool.cached_prefix([1, 2, 3, 4], 3) == ([a], first)    # at most `limit` tokens: whole blocks only
    pool.release([a])
    taken = [pool.allocate() for _ in range(4)]               # the never-cached first, then the oldest freed
    assert taken[:2] == [3, 4] and pool.allocate() is None
    assert pool.cached_prefix([1, 2, 3, 4], 4) == ([], 0)     # reused blocks forget their content
    with pytest.raises(ValueError, match="holds nothing"):
        BlockPool(1, 16)


def _serve(model, prompts, n, echo=None, **kw):
    from bunsan.serve.batcher import Batcher, Request
    batcher = Batcher(model, **kw)
    got, finished, prompt_lp, most = [[] for _ in prompts], [], {}, [0]

    def emit(i, t):
        got[i].append(t.id)
        most[0] = max(most[0], len(batcher.running))

    for i, p in enumerate(prompts):
        batcher.submit(Request(p, n, emit=lambda t, i=i: emit(i, t), finish=finished.append, prompt_logprobs=echo,
                               on_prompt=lambda lp, i=i: prompt_lp.__setitem__(i, lp)))
    run_until_done(batcher, finished, len(prompts))
    return got, batcher, prompt_lp, most[0]


def _prompts():
    torch.manual_seed(0)
    shared = torch.randint(0, 200, (40,)).tolist()
    return [torch.randint(0, 200, (n,)).tolist() for n in (5, 17, 3, 30)] + [shared, shared + [7, 9], shared[:33]]


def _greedy(model, prompts, n):
    from bunsan.models import generate
    return [generate(model, torch.tensor([p]), n)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("kw", [dict(slots=2), dict(slots=4, num_blocks=12, block_size=8),
                                dict(slots=7, num_blocks=30, block_size=4, prefill_tokens=16),
                                dict(slots=3, prefix_reuse=False)],
                         ids=["roomy", "tight-pool", "chunked-prefill-and-preemption", "no-prefix-cache"])
def test_greedy_tokens_whatever_the_pool(model, kw):
    prompts = _prompts()
    got, batcher, _, _ = _serve(model, prompts, 20, max_len=96, **kw)
    assert got == _greedy(model, prompts, 20)
    if kw.get("prefix_reuse", True):
        assert batcher.reused_tokens >= 32                    # the shared prompt's whole blocks, taken again
    if "num_blocks" in kw:
        assert batcher.preempted > 0                          # the pool ran out: waited, never refused
    assert batcher.pool.available() == batcher.pool.usable    # every block back once all ended


def test_prompt_logprobs_survive_preemption_and_chunking(model):
    prompts = _prompts()[:4]
    _, _, want, _ = _serve(model, prompts, 12, echo=1, slots=4, max_len=96)
    _, batcher, got, _ = _serve(model, prompts, 12, echo=1, slots=4, max_len=96, num_blocks=14, block_size=4,
                                prefill_tokens=8)
    assert batcher.preempted > 0
    assert got.keys() == want.keys() == set(range(4))
    for i in want:
        assert [t.id for t in got[i]] == [t.id for t in want[i]] == prompts[i]
        assert [t.logprob for t in got[i][1:]] == pytest.approx([t.logprob for t in want[i][1:]], abs=1e-5)


def test_the_pool_holds_as_many_sequences_as_their_lengths_allow(model):
    """A budget of two full-context sequences (2 x 96 tokens) runs eight short ones at once."""
    torch.manual_seed(1)
    prompts = [torch.randint(0, 200, (6,)).tolist() for _ in range(8)]
    got, _, _, most = _serve(model, prompts, 10, slots=8, max_len=96, num_blocks=1 + 2 * 96 // 8, block_size=8)
    assert most == 8
    assert got == _greedy(model, prompts, 10)


def test_a_request_larger_than_the_pool_is_refused_at_once(model):
    from bunsan.serve.batcher import Batcher, Request
    batcher = Batcher(model, slots=2, max_len=96, num_blocks=5, block_size=8)
    with pytest.raises(ValueError, match="needs 5 KV blocks of 8 tokens; the cache holds 4"):
        batcher.submit(Request(list(range(30)), 10, emit=print, finish=print))


LAYOUTS = {   # (lengths, counts, block tables, the blocks shared, whether the prompt chunks share them too)
    # three decoding rows share blocks 1 and 2; a fresh prompt and a chunk after a cached prefix of its own
    "decoding-rows-share": ([9, 11, 8, 0, 5], [1, 1, 1, 6, 3],
                            [[1, 2, 3, 0], [1, 2, 4, 0], [1, 2, 5, 0], [6, 7, 0, 0], [8, 9, 0, 0]], 2, False),
    # every row after the same two blocks (a system prompt): the chunks join the cascade
    "every-row-shares": ([9, 11, 8, 8, 10], [1, 1, 1, 6, 3],
                         [[1, 2, 3, 0], [1, 2, 4, 0], [1, 2, 5, 0], [1, 2, 6, 7], [1, 2, 8, 9]], 2, True),
    # prompt chunks only (the step after many requests arrived at once), one of them past a third block
    "chunks-only": ([8, 12, 9], [5, 2, 4], [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8]], 2, True),
    # decoding rows sharing nothing, one of them in a single block (the in-place kernel pads it to two)
    "decoding-rows-own": ([2, 9], [1, 1], [[1, 0, 0], [2, 3, 4]], 0, False),
    # one decoding row alone (padded to two rows), beside a prompt chunk
    "one-decoding-row": ([6, 0], [1, 3], [[1, 2], [3, 0]], 0, False),
}


class _Shape(torch.nn.Module):
    """What PagedCache reads of a model: one layer of `heads` query and `kv` key/value heads of `hd`, on the CPU."""

    def __init__(self, heads: int, kv: int, hd: int, dtype: torch.dtype = torch.float32):
        from bunsan.serve.transformers_model import ServedShape
        super().__init__()
        self.config = ServedShape("x", 10, heads * hd, 1, heads, kv, hd, 64)
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=dtype))       # the pools take the weights' dtype
        self.input_device = torch.device("cpu")

    def cache_devices(self):
        return [torch.device("cpu")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5], ids=["full", "window"])
@pytest.mark.parametrize("reads", ["in place", "copies"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("softcap,sdpa", [(None, True), (None, False), (5.0, False)], ids=["sdpa", "eager", "softcap"])
def test_one_forward_of_decoding_and_prefilling_rows_attends_as_plain_causal_attention(softcap, sdpa, layout, reads,
                                                                                       window, dtype, monkeypatch):
    """One forward of decoding rows and prompt chunks, rows sharing their first two blocks (cascade attention:
    the shared blocks read once; with the chunks too when every row shares them): every token's output equals
    causal attention over its own sequence's keys (within a sliding window: no cascade), grouped heads
    included. The decoding rows' own blocks are read in place by the compiled kernel (paged_decode.py; not
    with softcap; here whatever their size, MIN_BYTES 0), or copied out for PyTorch's attention. A bf16 pool
    (the fused kernels read it in bf16) within bf16's rounding of the fp32 attention of the same values."""
    from bunsan.serve import paged_decode
    from bunsan.serve.paged import PagedCache
    monkeypatch.setattr(paged_decode, "MIN_BYTES", 0 if reads == "in place" else 1 << 60)
    calls = []
    monkeypatch.setattr(paged_decode.COMPILED, "fn", _counted(paged_decode.COMPILED, calls))
    torch.manual_seed(0)
    heads, kv, hd, bs = 4, 2, 8, 4
    cache = PagedCache(_Shape(heads, kv, hd, dtype), 20, bs)
    lengths, counts, tables, shared, joint = LAYOUTS[layout]
    tables = torch.tensor(tables)

    def randn(*shape):      # values the pool's dtype holds exactly, so the fp32 reference reads the same ones
        return torch.randn(*shape).to(dtype).float()
    history = {j: (randn(kv, lengths[j], hd), randn(kv, lengths[j], hd)) for j in range(len(lengths))}
    for j in history:                                         # rows on blocks 1 and 2 share their 8 tokens
        if j and tables[j, :2].tolist() == [1, 2]:
            for t in history[j]:
                t[:, :8] = history[0][0 if t is history[j][0] else 1][:, :8]
    for j, (k, v) in history.items():                       # the keys each row already holds
        for p in range(lengths[j]):
            block, at = int(tables[j, p // bs]), p % bs
            cache.k[0][block, at], cache.v[0][block, at] = k[:, p], v[:, p]
    n = sum(counts)
    q, k, v = randn(1, heads, n, hd), randn(1, kv, n, hd), randn(1, kv, n, hd)
    view = cache.view(tables, torch.tensor(lengths), torch.tensor(counts))
    assert (view.shared, view.joint) == (shared, joint)
    view.windows = [window]
    out = view.layer(0).attend(*(t.to(dtype) for t in (q, k, v)), None, softcap, sdpa)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for j in range(len(lengths)):
        c = counts[j]
        keys = torch.cat([history[j][0], k[0, :, start:start + c]], 1).repeat_interleave(heads // kv, 0)
        values = torch.cat([history[j][1], v[0, :, start:start + c]], 1).repeat_interleave(heads // kv, 0)
        scores = q[0, :, start:start + c] @ keys.transpose(1, 2) * hd ** -0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        at = lengths[j] + torch.arange(c)[:, None]
        causal = (torch.arange(lengths[j] + c)[None, :] <= at) & (torch.arange(lengths[j] + c)[None, :] > at - (
            window or 10 ** 6))
        want = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ values
        torch.testing.assert_close(out[0, :, start:start + c].float(), want, rtol=tolerance, atol=tolerance)
        start += c
    # (cascade attention runs the fused kernels whatever `sdpa` says: the eager form's only for unshared rows)
    cascade = shared > 0 and window is None
    assert bool(calls) == (reads == "in place" and softcap is None and 1 in counts and (sdpa or cascade)), calls


def test_decoding_reads_in_place_only_past_min_bytes(monkeypatch):
    """A decoding batch whose keys and values a layer come to MIN_BYTES or more reads them in place; a smaller
    one copies them (the copy stays in the cache)."""
    from bunsan.serve import paged_decode
    pool, q = torch.zeros(40, 16, 4, 64), torch.zeros(2, 4, 2, 64)     # a block: 16 KiB of keys, 16 of values
    assert paged_decode.in_place(q, pool)                               # (no batch given: the kernel works)
    monkeypatch.setattr(paged_decode, "MIN_BYTES", 32 << 10)
    assert paged_decode.in_place(q, pool, torch.zeros(1, 1, dtype=torch.long))
    assert not paged_decode.in_place(q, pool, torch.zeros(1, 1, dtype=torch.long)[:, :0])
    monkeypatch.setattr(paged_decode, "MIN_BYTES", 4 << 20)
    assert not paged_decode.in_place(q, pool, torch.zeros(2, 63, dtype=torch.long))  # 2 x 63 x 32 KiB < 4 MiB
    assert paged_decode.in_place(q, pool, torch.zeros(2, 64, dtype=torch.long))


def _counted(compiled, calls: list):
    """The compiled kernel (compiled the first time), each call's rows and blocks noted in `calls`."""
    compiled.usable(torch.zeros(1, 1, 2, 8), torch.zeros(1, 4, 1, 8))
    fn = compiled.fn

    def counted(q, pool_k, pool_v, slots, bias, scale):
        calls.append(tuple(slots.shape))
        return fn(q, pool_k, pool_v, slots, bias, scale)
    return counted


def test_a_failed_kernel_call_falls_back_to_copies_and_says_so(monkeypatch, caplog):
    """A compiled call that raises (a shape or build the probe did not meet) costs that forward nothing: its
    rows are read through copies, a warning says so once, and the kernel is not called again."""
    from bunsan.serve import paged_decode
    from bunsan.serve.paged import PagedCache
    fresh = paged_decode._Compiled()
    monkeypatch.setattr(paged_decode, "COMPILED", fresh)
    monkeypatch.setattr(paged_decode, "MIN_BYTES", 0)
    assert fresh.usable(torch.zeros(1, 2, 2, 8), torch.zeros(1, 4, 2, 8))
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("inductor: an unsupported shape")
    fresh.fn = broken
    torch.manual_seed(0)
    cache = PagedCache(_Shape(4, 2, 8), 8, 4)
    cache.k[0].normal_(), cache.v[0].normal_()
    tables, lengths, counts = torch.tensor([[1, 2], [3, 0]]), torch.tensor([5, 2]), torch.tensor([1, 1])
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    with caplog.at_level("WARNING", logger="bunsan.serve.paged_decode"):
        out = cache.view(tables, lengths, counts).layer(0).attend(q, k, v)
        again = cache.view(tables, lengths, counts).layer(0).attend(q, k, v)
    monkeypatch.setattr(paged_decode, "MIN_BYTES", 1 << 60)             # the copies, as the reference
    want = cache.view(tables, lengths, counts).layer(0).attend(q, k, v)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    assert len(calls) == 1 and not paged_decode.in_place(torch.zeros(1, 2, 2, 8), cache.k[0])
    assert [r.getMessage() for r in caplog.records] == [
        "the compiled paged decode attention failed (RuntimeError: inductor: an unsupported shape); decoding "
        "reads the blocks through copies from now on"]


def test_without_a_compiler_decoding_reads_copies_and_says_so(monkeypatch, caplog):
    """Where torch.compile fails (no C++ compiler), the probe says so once and decoding takes the copies."""
    from bunsan.serve import paged_decode

    def broken(*a, **k):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
    fresh = paged_decode._Compiled()
    monkeypatch.setattr(paged_decode, "COMPILED", fresh)
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="bunsan.serve.paged_decode"):
        assert not paged_decode.in_place(torch.zeros(2, 2, 2, 8), torch.zeros(3, 4, 2, 8))
        assert not paged_decode.in_place(torch.zeros(2, 2, 2, 8), torch.zeros(3, 4, 2, 8))
    assert [r.getMessage() for r in caplog.records] == [
        "paged decode attention not compiled (RuntimeError: InvalidCxxCompiler: No working C++ compiler found); "
        "decoding reads the blocks through copies"]
