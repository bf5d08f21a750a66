"""DeepSpeed's offload_states / reload_states (zero/park.py): every kind of state leaves the device and comes
back bit for bit. On a GPU the storages are CUDA ones; the mechanism is the same on the host, so it is
checked here by parking the CPU engine's own storages (which offload_states leaves alone on a CPU run)."""

from __future__ import annotations

import pytest
import torch

import bunsan
from bunsan.zero.park import KINDS, park, state_tensors
from parity import batches, optimizer_config, tiny_model


def _train(rank, world, stage, dtype, park_after):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": optimizer_config("adamw"), dtype: {"enabled": True}} if dtype != "fp32" else \
        {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
         "optimizer": optimizer_config("adamw")}
    engine = bunsan.initialize(tiny_model(), cfg)
    losses, emptied = [], None
    for step, batch in enumerate(batches(3, 2 * world, 8)):
        losses.append(float(engine.train_batch({k: v[2 * rank:2 * rank + 2] for k, v in batch.items()})))
        if step == park_after:
            held = state_tensors(engine.strategy)
            parked = park(engine.strategy, None, torch.device("cpu"), pin_memory=False)
            emptied = {k: all(t.untyped_storage().nbytes() == 0 for t in ts) and bool(ts) for k, ts in held.items()}
            emptied["bytes"], emptied["kept"] = parked.nbytes(), {k for k, _ in parked.kept}
            parked.reload()
    return losses, emptied


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
def test_parked_states_come_back_exactly(pools, stage, dtype):
    plain = pools.run(2, _train, 2, stage, dtype, -1)
    parked = pools.run(2, _train, 2, stage, dtype, 0)
    for (want, _), (got, emptied) in zip(plain, parked):
        assert got == want                                       # bit for bit after the round trip
        assert emptied["optim_states"] and emptied["lp_params"] and emptied["bytes"] > 0
        # stage 0 keeps no master for an fp32 model; stages 1-3 alias it to the shard (parked once, with it)
        assert emptied["hp_params"] == (dtype != "fp32" or stage > 0)
        assert emptied["kept"] <= {"lp_grads"}       # only the host mapping of the gradients (CPU runs only)


def _some_kinds(rank, world):
    engine = bunsan.initialize(tiny_model(), {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                              "zero_optimization": {"stage": 2},
                                              "optimizer": optimizer_config("adamw")})
    engine.train_batch({k: v[2 * rank:2 * rank + 2] for k, v in batches(1, 2 * world, 8)[0].items()})
    held = state_tensors(engine.strategy)
    parked = park(engine.strategy, ["optim_states"], torch.device("cpu"), pin_memory=False)
    out = {k: all(t.untyped_storage().nbytes() == 0 for t in ts) for k, ts in held.items() if ts}
    parked.reload()
    with pytest.raises(ValueError, match="kinds of state"):
        park(engine.strategy, ["weights"], torch.device("cpu"))
    return out


def test_include_parks_only_the_kinds_named(pools):
    for emptied in pools.run(2, _some_kinds, 2):
        assert emptied["optim_states"] and not emptied["hp_params"] and not emptied["lp_params"]


def test_the_engine_refuses_to_run_while_offloaded_and_resumes_after_reload():
    import bunsan.deepspeed as deepspeed
    from bunsan.deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    engine, *_ = deepspeed.initialize(model=net, config={
        "train_batch_size": 2, "steps_per_print": 100, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}})
    x = torch.randn(2, 4)
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)
    with pytest.raises(RuntimeError, match="reload_states"):
        engine(x)
    with pytest.raises(RuntimeError, match="twice"):
        engine.offload_states()
    engine.reload_states()
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and set(KINDS) >= {"optim_states", "lp_params"}
