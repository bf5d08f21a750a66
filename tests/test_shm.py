"""Collectives through shared memory (bunsan/comm/shm.py): the rank-order sum, any dtype and layout, chunked; a late
peer is a clear error, not a hang; where a rank cannot map the file no rank uses it."""

from __future__ import annotations

import os

import pytest
import torch

from bunsan.comm import shm
from bunsan.comm.collectives import Comm, CommError
from bunsan.comm.mesh import Mesh

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
            want_tiny = _tensor(0, 20 + k, (1,), dtype)
            for r in range(1, world):
                want_tiny = want_tiny + _tensor(r, 20 + k, (1,), dtype)
            flat, grid, tiny = out[k]
            assert torch.equal(flat, want_sum), name
            assert torch.equal(grid, want_max), name
            assert not grid.is_contiguous()
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


def _open_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:             # the directory listing's own descriptor, closed by now
            pass
    return out


def _set_up(rank, world, fail_rank, fail_at):
    """One all-reduce with the set-up failing on `fail_rank` at `fail_at` ('create': rank 0 cannot make the
    file; 'map': a rank cannot map it); every rank must take the same transport and get the right sum."""
    saved = getattr(shm, f"_{fail_at}")
    if rank == fail_rank:
        def refuse(*_args):
            if fail_at == "map":
                raise OSError("refused by the test")
            return None
        setattr(shm, f"_{fail_at}", refuse)
    try:
        group = Mesh.create().dp_group
        comm = Comm(timeout_s=30)
        t = torch.arange(5, dtype=torch.float32) * (rank + 1)
        comm.all_reduce(t, group)
        return comm.transport(group), t, [f for f in _open_files() if "bunsan-shm" in f]
    finally:
        setattr(shm, f"_{fail_at}", saved)


@pytest.mark.parametrize("fail_rank,fail_at", [(None, "map"), (1, "map"), (2, "map"), (0, "create")])
def test_no_rank_uses_shared_memory_unless_every_rank_maps_it(pools, fail_rank, fail_at):
    world = 3
    for transport, t, fds in pools.run(world, _set_up, world, fail_rank, fail_at):
        assert transport == ("shm" if fail_rank is None else "exchange")
        assert torch.equal(t, torch.arange(5, dtype=torch.float32) * 6)
        # the ring's file never had a name (a memfd, held only by the mappings): nothing can be left behind
        assert all(f.startswith("/memfd:bunsan-shm") for f in fds)


def _gather_scatter_strided(rank, world):
    group = Mesh.create().dp_group
    comm = Comm(timeout_s=30)
    shard = (torch.arange(12, dtype=torch.float64) + 100 * rank).view(3, 4).t()      # [4, 3], non-contiguous
    out = torch.empty(3, 4 * world, dtype=torch.float64).t()                           # [4 x world, 3] likewise
    comm.all_gather(out, shard, group)
    full = (torch.arange(6 * world, dtype=torch.float64) * (rank + 1)).view(2, 3 * world).t()   # [3 x world, 2]
    mine = torch.empty(2, 3, dtype=torch.float64).t()                                  # [3, 2], non-contiguous
    comm.reduce_scatter(mine, full, group)
    return comm.transport(group), out, mine


def test_all_gather_and_reduce_scatter_take_strided_tensors(pools):
    world = 2
    ranks = range(world)
    for rank, (transport, out, mine) in enumerate(pools.run(world, _gather_scatter_strided, world)):
        assert transport == "shm"
        want_out = torch.cat([(torch.arange(12, dtype=torch.float64) + 100 * r).view(3, 4).t() for r in ranks])
        assert torch.equal(out, want_out)
        fulls = [(torch.arange(6 * world, dtype=torch.float64) * (r + 1)).view(2, 3 * world).t() for r in ranks]
        assert torch.equal(mine, (fulls[0] + fulls[1])[3 * rank:3 * (rank + 1)])


PEER_EXIT_CEILING_S = 120      # only a hang reaches it: the collective's own timeout is far past it


def _exits_midway(rank: int, port: int, results) -> None:
    import datetime

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    wait = datetime.timedelta(seconds=10 * PEER_EXIT_CEILING_S)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=wait)
    group = Mesh.create().dp_group
    # a timeout the test never reaches: only noticing the exit can end the wait in time
    comm = Comm(timeout_s=10 * PEER_EXIT_CEILING_S)
    comm.all_reduce(torch.ones(4), group)           # the ring is set up; both ranks took part
    if rank == 1:
        os._exit(0)                                 # gone without a word: no gloo call will tell rank 0
    try:
        comm.all_reduce(torch.ones(4), group)
        results.put("no error")
    except CommError as e:
        results.put(str(e))
    results.close()
    results.join_thread()                           # flushed before leaving
    os._exit(0)                                     # the process group's peer is gone: skip its teardown


def test_a_peer_process_that_exits_is_noticed_not_waited_for():
    from dist_harness import CONTEXT      # (forked from the harness' preloaded forkserver: no interpreter start-up)
    from node_harness import free_port
    results = CONTEXT.Queue()
    port = free_port()
    procs = [CONTEXT.Process(target=_exits_midway, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        msg = results.get(timeout=PEER_EXIT_CEILING_S)
    finally:
        for p in procs:
            p.join(timeout=PEER_EXIT_CEILING_S)
            if p.is_alive():
                p.kill()
    assert "the process of rank(s) [1] exited" in msg, msg      # noticed, not timed out


def _engines_in_a_row(rank, world, cfg, rounds):
    """A program that builds, trains and drops an engine `rounds` times: the rings each one mapped go with it."""
    import gc

    from dist_harness import mapped_rings
    from parity import Setup, train
    held = []
    for _ in range(rounds):
        train(rank, world, cfg, Setup(steps=1, rows=4, seq=16))
        gc.collect()                    # (Python collects cycles by itself too, later)
        held.append(mapped_rings())
    return held


@pytest.mark.parametrize("cfg", [
    {"zero_optimization": {"stage": 1}},                                          # gradient hooks on parameters
    {"tensor_parallel": {"size": 2, "sequence_parallel": True}},                  # autograd nodes kept by regions
], ids=["zero1", "tp2-sp"])
def test_engines_built_in_a_row_release_their_shared_memory(pools, cfg):
    cfg = {"train_micro_batch_size_per_gpu": 2 if "zero_optimization" in cfg else 4,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **cfg}
    for held in pools.run(2, _engines_in_a_row, 2, cfg, 3):
        assert held == [0, 0, 0]
