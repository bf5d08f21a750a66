"""engine.gathered_parameters: whole parameters to read, or to change on one rank and keep everywhere
(DeepSpeed's GatheredParameters(modifier_rank=...)); a write that would be lost is an error, never silent."""

from __future__ import annotations

import pytest

import bunsan
from parity import batches, tiny_model

ROWS = 4


def _cfg(stage: int, bf16: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": ROWS // 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _modify(rank, world, stage, bf16):
    engine = bunsan.initialize(tiny_model(), _cfg(stage, bf16))
    data = batches(2, ROWS)
    engine.train_batch({k: v[rank * 2:(rank + 1) * 2] for k, v in data[0].items()})
    with engine.gathered_parameters(modifier_rank=0):
        w = engine.module.layers[0].mlp.up_proj.weight
        if rank == 0:
            w.data.fill_(0.5)
        else:
            w.data.fill_(-3.0)     # not the modifier: overwritten by rank 0's values
    with engine.gathered_parameters():
        inside = float(engine.module.layers[0].mlp.up_proj.weight.detach().float().mean())
    full = engine.consolidated_state_dict()["layers.0.mlp.up_proj.weight"]
    # the masters carry it too: one more step starts from 0.5, not from the old weights
    loss = engine.train_batch({k: v[rank * 2:(rank + 1) * 2] for k, v in data[1].items()})
    after = engine.consolidated_state_dict()["layers.0.mlp.up_proj.weight"]
    return inside, float(full.float().mean()), float(full.float().std()), float((after.float() - 0.5).abs().max()), loss


@pytest.mark.parametrize("stage,bf16", [(0, False), (0, True), (1, True), (2, False), (3, False), (3, True)])
def test_what_the_modifier_rank_writes_is_kept_on_every_rank(pools, stage, bf16):
    results = pools.run(2, _modify, 2, stage, bf16)
    for inside, mean, std, drift, loss in results:
        assert inside == pytest.approx(0.5) and mean == pytest.approx(0.5) and std == 0.0
        assert drift < 0.1          # one SGD step moved it a little from 0.5, not back to the old weights
    assert results[0][4] == results[1][4]


def _write_without_modifier(rank, world, stage):
    engine = bunsan.initialize(tiny_model(), _cfg(stage, False))
    with pytest.raises(RuntimeError, match=r"layers.0.mlp.up_proj.weight.*pass modifier_rank"):
        with engine.gathered_parameters():
            engine.module.layers[0].mlp.up_proj.weight.data.fill_(1.0)
    with pytest.raises(ValueError, match="modifier_rank 5 is not a data-parallel rank"):
        with engine.gathered_parameters(modifier_rank=5):
            pass
    return True


@pytest.mark.parametrize("stage", [0, 3])
def test_a_write_without_a_modifier_rank_is_refused_not_lost(pools, stage):
    assert pools.run(2, _write_without_modifier, 2, stage) == [True, True]

