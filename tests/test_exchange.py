"""All-gather and reduce-scatter as point-to-point exchanges on gloo (bunsan/comm/exchange.py) and through shared memory
(bunsan/comm/shm.py) equal torch's own."""

from __future__ import annotations

import pytest
import torch

from bunsan.comm import shm
from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh


def _inputs(rank: int, world: int, numel: int, k: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(numel * world, generator=g).to(dtype)


def _collectives(rank, world, mode, dtype_name, tp):
    slot = shm.SLOT_BYTES
    shm.SLOT_BYTES = 256          # tiny slots: the 1031-element tensors go through shared memory in chunks
    try:
        return _run_collectives(world, mode, dtype_name, tp)
    finally:
        shm.SLOT_BYTES = slot


def _run_collectives(world, mode, dtype_name, tp):
    dtype = getattr(torch, dtype_name)
    mesh = Mesh.create(tp=tp)
    comm = Comm(timeout_s=30, gloo_collectives=mode)
    out = {}
    for gname, group in (("dp", mesh.dp_group), ("tp", mesh.tp_group)):
        if group.size == 1:
            continue
        # Several of each in flight at once, interleaved, of uneven sizes: tags must keep them apart.
        handles, results = [], []
        for k, numel in enumerate((5, 1031, 64, 7)):
            full = _inputs(group.rank, group.size, numel, k, dtype)
            rs = torch.empty(numel, dtype=dtype)
            handles.append(comm.reduce_scatter(rs, full, group, async_op=True))
            shard = _inputs(group.rank, 1, numel, 100 + k, dtype)
            ag = torch.empty(numel * group.size, dtype=dtype)
            handles.append(comm.all_gather(ag, shard, group, async_op=True))
            results.append((full, rs, ag))       # keep `full` alive until the wait
        for h in handles:
            h.wait()
        out[gname] = [(rs, ag) for _, rs, ag in results]
        # A blocking call after the async ones, into a 2-D output as the tensor-parallel ops pass it.
        shard2 = torch.full((3, 4), float(group.rank), dtype=dtype)
        ag2 = torch.empty(3 * group.size, 4, dtype=dtype)
        comm.all_gather(ag2, shard2, group)
        out[gname].append((None, ag2))
        assert comm.transport(group) == mode       # shared memory where asked for: these ranks share a host
    stats = comm.stats.summary()["total"]
    return out, {k: v["bytes"] for k, v in stats.items()}


def _expected(world_group_size: int, group_rank: int, numel: int, k: int, dtype):
    """The reduce-scatter chunk of this rank as a sequential sum over ranks, and the all-gather result."""
    fulls = [_inputs(r, world_group_size, numel, k, dtype) for r in range(world_group_size)]
    rs = fulls[0][group_rank * numel:(group_rank + 1) * numel].clone()
    for r in range(1, world_group_size):
        rs += fulls[r][group_rank * numel:(group_rank + 1) * numel]
    ag = torch.cat([_inputs(r, 1, numel, 100 + k, dtype) for r in range(world_group_size)])
    return rs, ag


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["exchange", "shm"])
def test_exchange_equals_native_and_the_sequential_sum(pools, world, tp, dtype_name, mode):
    ex = pools.run(world, _collectives, world, mode, dtype_name, tp)
    nat = pools.run(world, _collectives, world, "native", dtype_name, tp)
    dtype = getattr(torch, dtype_name)
    for rank in range(world):
        (got, bytes_ex), (ref, bytes_nat) = ex[rank], nat[rank]
        assert bytes_ex == bytes_nat      # accounting is the algorithm's, not the backend's
        for gname in got:
            size = world // tp if gname == "dp" else tp
            grank = rank // tp if gname == "dp" else rank % tp
            for k, numel in enumerate((5, 1031, 64, 7)):
                rs_want, ag_want = _expected(size, grank, numel, k, dtype)
                rs, ag = got[gname][k]
                assert torch.equal(ag, ag_want) and torch.equal(ag, ref[gname][k][1])
                assert torch.equal(rs, rs_want)                    # rank-order sum, bit for bit
                # torch's own may sum in another order: a few units in the last place of the partial sums
                tol = {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
                torch.testing.assert_close(rs, ref[gname][k][0], **tol)
            assert torch.equal(got[gname][-1][1], ref[gname][-1][1])


def test_unknown_gloo_collectives_mode_is_refused():
    with pytest.raises(ValueError, match="gloo_collectives='ring'"):
        Comm(gloo_collectives="ring")
