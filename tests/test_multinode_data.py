"""Several machines, each with its own disk: every node builds (or finds) its own token cache, keyed by the
corpus' content, and every rank checks that all of them tokenised the same corpus."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np

from bunsan.training.data import TokenCache


def _corpus(d, text="def f():\n    return 1\n" * 50):
    d.mkdir(parents=True, exist_ok=True)
    (d / "a.py").write_text(text)
    (d / "b.py").write_text(text.upper())
    return [d / "a.py", d / "b.py"]


def test_the_cache_key_is_the_content_not_the_path_or_mtime(tmp_path):
    one = _corpus(tmp_path / "node0")
    (tmp_path / "node1").mkdir()
    two = [tmp_path / "node1" / f.name for f in one]          # the same bytes elsewhere, with other mtimes
    for f, g in zip(one, two):
        shutil.copyfile(f, g)
    os.utime(two[0], (time.time() - 1000, time.time() - 1000))
    assert TokenCache(one, cache_dir=tmp_path / "c0").key == TokenCache(two, cache_dir=tmp_path / "c1").key
    two[0].write_text("something else\n")
    assert TokenCache(one, cache_dir=tmp_path / "c0").key != TokenCache(two, cache_dir=tmp_path / "c2").key


def _node_local(rank, world, root, differ):
    """Each rank plays a node of its own: LOCAL_RANK 0, its own corpus copy and cache directory."""
    from pathlib import Path
    from bunsan.training.sources import corpus_tokens
    os.environ["LOCAL_RANK"] = "0"
    files = _corpus(Path(root) / f"node{rank}", "other text\n" * 40 if differ and rank == 1 else
                    "def f():\n    return 1\n" * 50)
    cache = TokenCache(files, cache_dir=Path(root) / f"cache{rank}")
    try:
        tokens = corpus_tokens(cache)
    except ValueError as e:
        return str(e)
    return cache.builds, np.asarray(tokens).tolist()


def test_every_node_builds_its_own_cache(pools, tmp_path):
    (b0, t0), (b1, t1) = pools.run(2, _node_local, 2, str(tmp_path), False)
    assert b0 == b1 == 1 and t0 == t1


def test_a_node_with_another_corpus_is_named(pools, tmp_path):
    messages = pools.run(2, _node_local, 2, str(tmp_path), True)
    assert all(isinstance(m, str) and "rank(s) [1]" in m and "another corpus and tokenizer" in m for m in messages)


def _check_dir(rank, world, root, local):
    import bunsan
    from bunsan.checkpoint import check_shared
    from parity import tiny_model
    engine = bunsan.initialize(tiny_model(0), {"train_micro_batch_size_per_gpu": 1})
    d = f"{root}/node{rank}" if local else f"{root}/shared"       # node-local disks: the same path, other dirs
    try:
        check_shared(engine, d)
    except Exception as e:        # noqa: BLE001  (the message is what is checked)
        return f"{type(e).__name__}: {e}"
    return None


def test_a_checkpoint_directory_that_is_not_shared_is_found_at_start_up(pools, tmp_path):
    assert pools.run(2, _check_dir, 2, str(tmp_path), False) == [None, None]
    messages = pools.run(2, _check_dir, 2, str(tmp_path), True)
    assert all(m and "is not shared: rank(s) [1]" in m for m in messages), messages
    assert not list(tmp_path.rglob(".bunsan-shared-check"))


def _saved_mode(rank, world, root):
    import stat
    import bunsan
    from parity import tiny_model
    engine = bunsan.initialize(tiny_model(0), {"train_micro_batch_size_per_gpu": 1})
    path = engine.save_checkpoint(root)
    return sorted(stat.S_IMODE(os.stat(f).st_mode) & 0o044 for f in path.iterdir())


def test_checkpoint_files_are_readable_by_every_rank(pools, tmp_path):
    assert set(pools.run(2, _saved_mode, 2, str(tmp_path / "D"))[0]) == {0o044}
