"""Tokenizers, corpus discovery, token cache, and deterministic data-parallel batches."""
import math
import os
import pickle

import numpy as np
import pytest
import torch

from bunsan.training.data import (ByteTokenizer, HFTokenizer, TokenBatches, TokenCache, default_corpus_files, load_tokenizer, make_loader, resolve_paths, unigram_entropy)


@pytest.fixture
def corpus(tmp_path):
    """A small on-disk corpus and its cached tokens (~60k tokens)."""
    d = tmp_path / "docs"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        words = rng.choice(["def", "return", "x", "(", ")", ":", "\n", "    ", "class", "é"], size=4000)
        (d / f"f{i}.py").write_text(" ".join(words), encoding="utf-8")
    (d / ".hidden").write_text("never read")
    cache = TokenCache(resolve_paths([str(d)]), ByteTokenizer(), cache_dir=tmp_path / "cache")
    return cache, cache.load()


def test_byte_tokenizer_roundtrip():
    tok = load_tokenizer(None)
    s = "def f(x):\n    return 'héllo ✓'"
    ids = tok.encode(s)
    assert tok.vocab_size == 256 and tok.eos_token_id is None
    assert ids == list(s.encode("utf-8")) and tok.decode(ids) == s
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # truncated UTF-8 is replaced, not an error


def test_hf_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        HFTokenizer(missing)


def test_hf_tokenizer_roundtrip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3, "\n": 4}
    t = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 5 and tok.eos_token_id == 0
    assert tok.encode("abc") == [1, 2, 3]
    cache = TokenCache([_write(tmp_path / "a.txt", "ab"), _write(tmp_path / "b.txt", "c")], tok,
                       cache_dir=tmp_path / "cache")
    assert cache.load().tolist() == [1, 2, 0, 3, 0]  # documents separated by eos


def _write(p, text):
    p.write_text(text)
    return p


def test_default_corpus_nonempty_and_deterministic():
    a, b = default_corpus_files(), default_corpus_files()
    assert a == b and len(a) > 100
    assert all(p.suffix == ".py" for p in a)
    parts = {part for p in a for part in p.parts}
    assert not parts & {"site-packages", "test", "tests", "idlelib"}
    assert any(p.name == "argparse.py" for p in a)


def test_resolve_paths(tmp_path):
    (tmp_path / "a.py").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y")
    got = resolve_paths([str(tmp_path / "*.py"), str(tmp_path), str(tmp_path / "sub" / "b.py")])
    assert [p.name for p in got] == ["a.py", "b.py"]  # de-duplicated, in order
    with pytest.raises(FileNotFoundError, match=r"\*\.rs"):
        resolve_paths([str(tmp_path / "*.rs")])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        resolve_paths([str(tmp_path / "missing.txt")])


def test_token_cache_reused_and_atomic(corpus, tmp_path):
    cache, tokens = corpus
    assert tokens.dtype == np.uint16 and cache.builds == 1
    assert tokens[-1] == ord("\n")
    mtime = os.stat(cache.path).st_mtime_ns
    again = TokenCache(cache.files, ByteTokenizer(), cache_dir=cache.cache_dir)
    t2 = again.load()
    assert again.builds == 0 and os.stat(cache.path).st_mtime_ns == mtime
    assert np.array_equal(t2, tokens)
    assert not [p for p in cache.cache_dir.iterdir() if p.name.endswith(".tmp")]
    # Two writers racing: each publishes a complete file; content identical.
    again.build()
    assert np.array_equal(np.load(cache.path, mmap_mode="r"), tokens)
    # Content change -> new key; max_bytes -> new key and a capped array.
    capped = TokenCache(cache.files, ByteTokenizer(), cache_dir=cache.cache_dir, max_bytes=100)
    assert capped.path != cache.path and len(capped.load()) <= 100 + len(cache.files)
    old_path = cache.path
    cache.files[0].write_text("changed")
    assert TokenCache(cache.files, ByteTokenizer(), cache_dir=cache.cache_dir).path != old_path


def test_token_cache_wait_times_out(tmp_path):
    f = _write(tmp_path / "a.txt", "abc")
    with pytest.raises(TimeoutError, match="rank 0"):
        TokenCache([f], cache_dir=tmp_path / "c").load(build=False, timeout=0.3)


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1] * 50, dtype=np.uint16)) == pytest.approx(math.log(2))
    assert unigram_entropy(np.zeros(10, dtype=np.uint16)) == pytest.approx(0.0)


def test_labels_shifted_and_windows_disjoint(corpus):
    _, tokens = corpus
    b = TokenBatches(tokens, seq_len=32, global_batch=8, seed=0)
    batch = next(b)
    assert batch["input_ids"].shape == (8, 32) and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    ids = b.window_ids(0)
    row = torch.from_numpy(tokens[ids[0] * 33: ids[0] * 33 + 33].astype(np.int64))
    assert torch.equal(batch["input_ids"][0], row[:-1]) and torch.equal(batch["labels"][0], row[1:])
    # One epoch visits every train window exactly once.
    seen = np.concatenate([b.window_ids(k * 8) for k in range(b.steps_per_epoch)])
    assert len(set(seen.tolist())) == len(seen) == b.steps_per_epoch * 8
    train = TokenBatches(tokens, 32, 8, val_fraction=0.1)
    val = TokenBatches(tokens, 32, 8, split="val", val_fraction=0.1)
    assert val.n_windows + train.n_windows == len(tokens) // 33
    val_ids = np.concatenate([val.window_ids(k * 8) for k in range(val.steps_per_epoch)])
    assert set(val_ids.tolist()).isdisjoint(range(train.n_windows)) and val_ids.min() == train.n_windows


@pytest.mark.parametrize("dp", [2, 4])
def test_rank_slices_concat_equals_single_process(corpus, dp):
    _, tokens = corpus
    single = TokenBatches(tokens, 32, 8, seed=5)
    ranks = [TokenBatches(tokens, 32, 8, dp_rank=r, dp_size=dp, seed=5) for r in range(dp)]
    for _ in range(3):
        ref = next(single)
        parts = [next(rb) for rb in ranks]
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([p[key] for p in parts]), ref[key])
        ids = [set(rb.window_ids(rb.position - 8).tolist()) for rb in ranks]
        assert all(ids[i].isdisjoint(ids[j]) for i in range(dp) for j in range(i + 1, dp))


def test_seed_determinism_and_epoch_wrap(corpus):
    _, tokens = corpus
    a, b, c = (TokenBatches(tokens, 32, 8, seed=s) for s in (1, 1, 2))
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        assert torch.equal(x["input_ids"], y["input_ids"])
    assert not torch.equal(x["input_ids"], z["input_ids"])
    # A step that crosses the epoch boundary draws from the next epoch's permutation.
    pos = a.n_windows - 3
    ids = a.window_ids(pos)
    perm0 = np.random.default_rng(1).permutation(a.n_windows)
    perm1 = np.random.default_rng(2).permutation(a.n_windows)
    assert ids.tolist() == perm0[-3:].tolist() + perm1[:5].tolist()


def test_state_dict_resume_even_across_dp_sizes(corpus):
    _, tokens = corpus
    a = TokenBatches(tokens, 32, 8, seed=3)
    for _ in range(4):
        next(a)
    state = a.state_dict()
    expected = [next(a) for _ in range(3)]
    b = TokenBatches(tokens, 32, 8, seed=3)
    b.load_state_dict(state)
    for e in expected:
        assert torch.equal(next(b)["input_ids"], e["input_ids"])
    r1 = TokenBatches(tokens, 32, 8, dp_rank=1, dp_size=2, seed=3)
    r1.load_state_dict(state)
    assert torch.equal(next(r1)["input_ids"], expected[0]["input_ids"][4:])
    with pytest.raises(ValueError, match="seed"):
        TokenBatches(tokens, 32, 8, seed=4).load_state_dict(state)


def test_batch_errors(corpus):
    _, tokens = corpus
    with pytest.raises(ValueError, match="not divisible by data-parallel size 3"):
        TokenBatches(tokens, 32, 8, dp_size=3)
    with pytest.raises(ValueError, match="corpus too small"):
        TokenBatches(tokens[:1000], 32, 64)


def test_loader_workers_match_plain_iteration(corpus):
    _, tokens = corpus
    plain = make_loader(TokenBatches(tokens, 32, 8, seed=7))
    b = TokenBatches(tokens, 32, 8, seed=7)
    workers = make_loader(b, num_workers=2)
    ref = [x for _, x in zip(range(6), plain)]
    got = [x for _, x in zip(range(6), workers)]
    for r, g in zip(ref, got):
        assert torch.equal(r["input_ids"], g["input_ids"]) and torch.equal(r["labels"], g["labels"])
    assert b.position == 6 * 8  # position tracks what was handed out, for checkpoints


def test_memmap_pickles_by_path(corpus):
    _, tokens = corpus
    b = TokenBatches(tokens, 32, 8)
    blob = pickle.dumps(b)
    assert len(blob) < 10_000  # not a copy of the corpus
    assert torch.equal(pickle.loads(blob).batch_at(16)["input_ids"], b.batch_at(16)["input_ids"])
    sliced = TokenBatches(tokens[501:], 32, 8)  # a view into the mapping, not at its start
    assert torch.equal(pickle.loads(pickle.dumps(sliced)).batch_at(8)["labels"], sliced.batch_at(8)["labels"])
