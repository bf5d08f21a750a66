"""A save that runs out of disk: one message naming the directory and the bytes, the previous checkpoint
intact, no temporary files left; every rank stops together (none waits for one that gave up)."""

from __future__ import annotations

import errno
import subprocess

import pytest

import bunsan
from bunsan.checkpoint import store
from bunsan.checkpoint.store import CheckpointError
from parity import batches, rank_slice, tiny_model

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs: one tiny model's checkpoint (3.6 MB) fits, a second beside it does not."""
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield where
    subprocess.run(["umount", str(where)], capture_output=True)


def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_a_full_disk_keeps_the_previous_checkpoint(small_disk):
    engine = bunsan.initialize(tiny_model(0), CFG)
    engine.train_batch(batches(1, 2)[0])
    engine.save_checkpoint(small_disk / "D")
    engine.train_batch(batches(2, 2)[1])
    with pytest.raises(CheckpointError, match=r"saving checkpoint .*global_step2 failed .*bytes free there"):
        engine.save_checkpoint(small_disk / "D")
    assert _leftovers(small_disk / "D") == [] and (small_disk / "D" / "latest").read_text() == "global_step1"
    other = bunsan.initialize(tiny_model(5), CFG)
    assert other.load_checkpoint(small_disk / "D")[0].name == "global_step1"


def _full_on_rank1(rank, world, root):
    engine = bunsan.initialize(tiny_model(0), CFG)
    engine.train_batch(rank_slice(batches(1, 4)[0], rank, world))
    engine.save_checkpoint(root)
    real = store.save_file

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    if rank == 1:
        store.save_file = no_space
    try:
        engine.save_checkpoint(root, tag="global_step9")
    except CheckpointError as e:
        return str(e)
    finally:
        store.save_file = real       # (the worker process serves later tests)
    return None


def test_every_rank_stops_when_one_cannot_write(pools, tmp_path):
    messages = pools.run(2, _full_on_rank1, 2, str(tmp_path / "D"))
    assert all(m and "failed while writing it on 1 rank(s)" in m for m in messages), messages
    assert "No space left on device" in messages[1] and "this rank's part was written" in messages[0]
    assert _leftovers(tmp_path / "D") == [] and (tmp_path / "D" / "latest").read_text() == "global_step1"
