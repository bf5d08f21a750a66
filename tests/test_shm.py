"""Collectives through shared memory (bunsan/shm.py): the rank-order sum, any dtype and layout, chunked; a late
peer is a clear error, not a hang; where a rank cannot map the file no rank uses it."""

from __future__ import annotations

import os

import pytest
import torch

from bunsan import shm
from bunsan.comm import Comm, CommError
from bunsan.distributed import Mesh

DTYPES = ["float32", "bfloat16", "float64", "int64"]


def _tensor(rank: int, k: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(97 * k + rank)
    t = torch.randn(shape, generator=g) * 100
    return t.to(dtype)


def _all_reduces(rank, world, slot_bytes):
    saved, shm.SLOT_BYTES = shm.SLOT_BYTES, slot_bytes
    try:
        group = Mesh.create().dp_group
        comm = Comm(timeout_s=30)
        out = []
        for k, name in enumerate(DTYPES):
            dtype = getattr(torch, name)
            flat = _tensor(rank, k, (3001,), dtype)
            comm.all_reduce(flat, group)
            grid = _tensor(rank, 10 + k, (40, 30), dtype).t()        # non-contiguous: reduced in place all the same
            comm.all_reduce(grid, group, op="max")
            h = comm.all_reduce(tiny := _tensor(rank, 20 + k, (1,), dtype), group, async_op=True)
            h.wait()
            out.append((flat, grid, tiny))
        return comm.transport(group), out
    finally:
        shm.SLOT_BYTES = saved


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("slot_bytes", [64, 1 << 20])
def test_all_reduce_is_the_rank_order_sum_on_every_rank(pools, world, slot_bytes):
    results = pools.run(world, _all_reduces, world, slot_bytes)
    for transport, out in results:
        assert transport == "shm"
        for k, name in enumerate(DTYPES):
            dtype = getattr(torch, name)
            want_sum = _tensor(0, k, (3001,), dtype)
            for r in range(1, world):
                want_sum = want_sum + _tensor(r, k, (3001,), dtype)
            want_max = torch.stack([_tensor(r, 10 + k, (40, 30), dtype).t() for r in range(world)]).amax(0)
            want_tiny = sum(_tensor(r, 20 + k, (1,), dtype) for r in range(1, world)) + _tensor(0, 20 + k, (1,), dtype)
            flat, grid, tiny = out[k]
            assert torch.equal(flat, want_sum), name
            assert torch.equal(grid, want_max), name
            assert not grid.is_contiguous()
            if world == 2:          # a + b == b + a: the rank-order sum, whoever computes it
                assert torch.equal(tiny, want_tiny), name
    for _, out in results[1:]:      # every rank holds the same bits
        for a, b in zip(out, results[0][1]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def _late_peer(rank, world):
    group = Mesh.create().dp_group
    comm = Comm(timeout_s=2)
    comm.all_reduce(torch.ones(4), group)            # sets the ring up; both ranks take part
    if rank == 1:
        return None                                  # rank 1 skips the next all-reduce
    try:
        comm.all_reduce(torch.ones(4), group)
    except CommError as e:
        return str(e)
    return "no error"


def test_a_peer_that_never_comes_is_a_clear_error(pools):
    msg = pools.run(2, _late_peer, 2)[0]
    assert "timed out after 2s in shared memory waiting for rank(s) [1]" in msg
    assert "all_reduce #2 on group 'dp'" in msg


def _unmappable_on_rank1(rank, world):
    saved = shm.SHM_DIR
    if rank == 1:
        shm.SHM_DIR = "/nonexistent-bunsan-dir"     # only matters on group rank 0, which creates the file
    try:
        group = Mesh.create().dp_group
        comm = Comm(timeout_s=30)
        t = torch.full((5,), float(rank + 1))
        comm.all_reduce(t, group)
        left = [f for f in os.listdir(saved) if f.startswith(f"bunsan-{os.getpid()}-")]
        return comm.transport(group), t, left
    finally:
        shm.SHM_DIR = saved


def _unmappable_on_rank0(rank, world):
    saved = shm.SHM_DIR
    if rank == 0:
        shm.SHM_DIR = "/nonexistent-bunsan-dir"     # rank 0 cannot create it: nobody uses shared memory
    try:
        group = Mesh.create().dp_group
        comm = Comm(timeout_s=30)
        t = torch.full((5,), float(rank + 1))
        comm.all_reduce(t, group)
        return comm.transport(group), t
    finally:
        shm.SHM_DIR = saved


def test_no_rank_uses_shared_memory_unless_every_rank_maps_it(pools):
    for transport, t, left in pools.run(2, _unmappable_on_rank1, 2):
        assert transport == "shm" and torch.equal(t, torch.full((5,), 3.0)) and left == []   # unlinked at set-up
    for transport, t in pools.run(2, _unmappable_on_rank0, 2):
        assert transport == "exchange" and torch.equal(t, torch.full((5,), 3.0))
