"""Device rules of the door to the other ranks, checked on the CPU: which GPU a rank takes, tensors on the wrong
device, the timeouts per backend, and errors that blame a peer only when a peer may be to blame."""

from __future__ import annotations

import pytest
import torch

from bunsan.comm import process_group as distributed
from bunsan.comm.collectives import Comm, DeviceError, Group
from bunsan.comm.process_group import collective_timeout, pick_device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` visible GPUs."""
    def make(n: int, **env):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        for k in ("LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return make


def test_each_rank_takes_the_gpu_of_its_local_rank(gpus):
    gpus(4, LOCAL_RANK="3", WORLD_SIZE="8")
    assert pick_device() == torch.device("cuda", 3)
    gpus(1)
    assert pick_device() == torch.device("cuda", 0)      # a world of one, no launcher


def test_more_ranks_than_gpus_is_refused_under_nccl_naming_the_fix(gpus):
    gpus(2, LOCAL_RANK="2", WORLD_SIZE="4", CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 2 has no GPU of its own: 2 visible \(CUDA_VISIBLE_DEVICES="
                                           r"0,1\).*--nproc-per-node 2"):
        pick_device()
    with pytest.raises(RuntimeError, match="LOCAL_RANK 2 has no GPU"):
        pick_device("nccl")
    assert pick_device("gloo") == torch.device("cuda", 0)      # gloo may share a GPU


def test_a_rank_without_local_rank_is_refused_when_there_are_several(gpus):
    gpus(8, WORLD_SIZE="16")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE is 16 but LOCAL_RANK is not set.*8 visible GPUs.*torchrun"):
        pick_device()


def test_nccl_without_gpus_is_refused(gpus):
    gpus(0)
    assert pick_device() == torch.device("cpu")
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA GPUs"):
        pick_device("nccl")


def test_nccl_waits_ten_minutes_by_default_and_gloo_two():
    assert collective_timeout(None, "nccl") == 600.0 and collective_timeout(None, "gloo") == 120.0
    assert collective_timeout(5, "nccl") == 5.0


def test_init_process_group_gets_the_device_on_nccl(gpus, monkeypatch):
    gpus(2, LOCAL_RANK="1", WORLD_SIZE="2", RANK="1")
    seen = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set", d))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    store = object()        # the roll call's store (comm/launched.py), joined with the same bound
    monkeypatch.setattr(distributed, "join_store", lambda rank, world, s: seen.update(joined=(rank, world, s))
                        or store)
    assert distributed.init_distributed() == torch.device("cuda", 1)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)
    assert seen["timeout"].total_seconds() == 600 and seen["set"] == torch.device("cuda", 1)
    assert seen["store"] is store and (seen["rank"], seen["world_size"]) == (1, 2) and seen["joined"] == (1, 2, 600)


ONE = Group("dp", None, 1, 0, (0,))


def test_a_tensor_on_another_device_is_the_callers_error_even_in_a_group_of_one():
    comm = Comm(device=torch.device("meta"))
    with pytest.raises(DeviceError, match=r"all_reduce on group 'dp' was handed a tensor on cpu, but this rank's "
                                          r"collectives run on meta .* not a lost peer"):
        comm.all_reduce(torch.zeros(3), ONE)
    comm.all_reduce(torch.zeros(3, device="meta"), ONE)
    assert comm.tensors_checked == 1          # (the refused one is not counted)


def test_a_local_failure_is_not_blamed_on_a_peer():
    comm = Comm()
    local = comm.error("all_reduce", ONE, "Tensors must be contiguous")
    assert "this rank's own" in str(local) and "Another rank" not in str(local)
    lost = comm.error("all_reduce", ONE, "Connection closed by peer")
    assert "Another rank probably died" in str(lost)


def test_a_launcher_that_gives_each_process_its_own_gpu_is_understood(gpus):
    gpus(1, LOCAL_RANK="5", WORLD_SIZE="8", CUDA_VISIBLE_DEVICES="5")    # SLURM --gpus-per-task=1
    assert pick_device() == torch.device("cuda", 0)
    gpus(1, LOCAL_RANK="1", WORLD_SIZE="2")                              # one GPU for two ranks: refused
    with pytest.raises(RuntimeError, match="LOCAL_RANK 1 has no GPU of its own"):
        pick_device()


def test_an_offloaded_shards_norm_is_reduced_on_the_rank_device():
    """With offload_optimizer the fp32 gradient shard (and so its squared norm) is on the host; the norm's
    reductions and the engine's one read happen on the device."""
    from bunsan.zero.strategy import OtherDims, Sharded
    strategy = object.__new__(type("Bare", (Sharded,), dict.fromkeys(Sharded.__abstractmethods__, None)))
    strategy.comm, strategy.group, strategy.dims = Comm(device=torch.device("meta")), ONE, OtherDims()
    assert strategy.global_norm(torch.ones(1, dtype=torch.float64), sharded=True).device.type == "meta"
