"""The corpus is tokenised in one streaming pass: memory stays bounded whatever the corpus' size, and the
tokens are the same as tokenising each file whole."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from bunsan.training import stream
from bunsan.training.data import TokenCache, resolve_paths


@pytest.mark.e2e         # the peak memory of a fresh process: only a process of its own has one
def test_a_corpus_far_larger_than_the_memory_it_may_use(tmp_path):
    """256 MiB of text tokenised by a process whose peak memory grows by under 64 MiB."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = (b"def f(x):\n    return x * 2  # some text\n" * 64)
    for i in range(4):
        with open(corpus / f"part{i}.txt", "wb") as f:
            for _ in range((64 << 20) // len(line)):
                f.write(line)
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(sys.path[0])!r})
        from bunsan.training.data import TokenCache, resolve_paths
        files = resolve_paths([{str(corpus)!r}])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tokens = TokenCache(files, cache_dir={str(tmp_path / 'cache')!r}).load()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(tokens), (after - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, grew_mib = map(int, out.stdout.split())
    assert count == sum(f.stat().st_size + 1 for f in corpus.iterdir())
    assert grew_mib < 64, f"peak memory grew by {grew_mib} MiB while tokenising 256 MiB"
    assert "tokenised" in out.stderr                 # progress is shown


def test_pieces_give_the_tokens_of_whole_files(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    from bunsan.training.tokenizer import load_tokenizer
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = tokenizers.Tokenizer(models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n  # é ü 中\n" for i in range(400))
    (tmp_path / "big.py").write_text(text)
    (tmp_path / "small.py").write_text("x = 1\n")
    files = [tmp_path / "big.py", tmp_path / "small.py"]
    whole = TokenCache(files, tok, cache_dir=tmp_path / "c1").load().tolist()
    monkeypatch.setattr(stream, "PIECE", 333)        # the big file in ~50 pieces
    cut = TokenCache(files, tok, cache_dir=tmp_path / "c2").load().tolist()
    assert cut == whole
    sep = tok.separator_ids()
    assert whole == tok.encode(text) + sep + tok.encode("x = 1\n") + sep


def test_max_bytes_and_byte_tokens(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"line one\nline two\n" * 50)
    monkeypatch.setattr(stream, "PIECE", 64)
    tokens = TokenCache([tmp_path / "a.txt"], cache_dir=tmp_path / "c", max_bytes=500).load()
    assert tokens.tolist() == list((b"line one\nline two\n" * 50)[:500] + b"\n")


def test_a_named_pipe_in_the_data_is_refused(tmp_path):
    import os
    (tmp_path / "a.txt").write_text("hello\n")
    os.mkfifo(tmp_path / "b.txt")
    with pytest.raises(ValueError, match=r"is a named pipe \(FIFO\), not a file"):
        resolve_paths([str(tmp_path)])
    np.testing.assert_array_equal(TokenCache([tmp_path / "a.txt"], cache_dir=tmp_path / "c").load(),
                                  np.frombuffer(b"hello\n\n", np.uint8))


def test_a_tokenizer_that_rewrites_text_is_never_cut(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers
    from bunsan.training.tokenizer import load_tokenizer
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["▁"] = len(vocab)
    t = tokenizers.Tokenizer(models.BPE(vocab, []))
    t.normalizer = normalizers.Prepend("▁")           # SentencePiece-style: each piece would gain a prefix
    t.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.cuts == "never"
    text = "".join(f"line {i}\nnext\n" for i in range(300))
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(stream, "PIECE", 100)
    tokens = TokenCache([tmp_path / "big.txt"], tok, cache_dir=tmp_path / "c").load().tolist()
    assert tokens == tok.encode(text) + tok.separator_ids()
