"""Checkpoints under expert parallelism: resumed exactly on the same layout, and read by another expert-parallel
size (EP 2 -> 1 -> 2, under ZeRO 1 and 3, through pipeline stages, and with tensor parallelism cutting every
expert's width too); DeepSpeed's MoE layers' experts are
saved by global index, so a model built with another ep_size reads them.

Each case trains STEPS - 1 steps, saves, takes the last step; a fresh engine of the loading layout, built from
other weights, loads the checkpoint and takes the same last step: the same loss (rtol 1e-6) and the same
final weights as the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parity import rank_slice, to_numpy
from test_expert_parallel import MIXTRAL, data, layout, moe_model

import bunsan


def _engine(cfg: dict, seed: int):
    model = moe_model(MIXTRAL)
    if seed:
        model.init_weights(seed=seed)
    return bunsan.initialize(model, cfg)


def _save(rank: int, cfg: dict, path: str):
    engine = _engine(cfg, 0)
    batches = data()
    for b in batches[:-1]:
        engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size))
    engine.save_checkpoint(path)
    last = engine.train_batch(rank_slice(batches[-1], engine.dp_rank, engine.dp_size))
    return last, to_numpy(engine.consolidated_state_dict())


def _resume(rank: int, cfg: dict, path: str):
    engine = _engine(cfg, 7)
    engine.load_checkpoint(path)
    last = engine.train_batch(rank_slice(data()[-1], engine.dp_rank, engine.dp_size))
    return last, to_numpy(engine.consolidated_state_dict()), engine.global_step


CASES = {   # name: (saving layout, loading layout)
    "ep2-zero1 -> ep2-zero1": (layout(stage=1), layout(stage=1)),
    "ep2-zero1 -> ep1": (layout(stage=1), layout(ep=1)),
    "ep1-zero2 -> ep2-zero3": (layout(ep=1, stage=2), layout(stage=3)),
    "ep2-zero3 -> ep2-zero0": (layout(stage=3), layout()),
    "ep2-pp2 -> ep1-pp2": (layout(pp=2, m=2), layout(ep=1, pp=2, m=2)),
    # each expert cut both ways: its run of experts (dim 0) and its width (tensor parallelism)
    "ep2-tp2-zero1 -> ep1": (layout(tp=2, stage=1), layout(ep=1)),
    "ep1-tp2 -> ep2-tp2-zero3": (layout(ep=1, tp=2), layout(tp=2, stage=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_expert_parallel_checkpoint_resumes_on_any_expert_parallel_size(pools, tmp_path, name):
    (world, save_cfg, _, _), (load_world, load_cfg, _, _) = CASES[name]
    path = str(tmp_path / "ckpt")
    saved = pools.run(world, _save, save_cfg, path)
    resumed = pools.run(load_world, _resume, load_cfg, path)
    want_loss, want_state = saved[0]
    for loss, state, step in resumed:
        assert step == 3
        assert loss == pytest.approx(want_loss, rel=1e-6)
        for key, want in want_state.items():
            torch.testing.assert_close(torch.from_numpy(state[key]), torch.from_numpy(want), rtol=1e-5, atol=1e-6,
                                       msg=key)


# -- DeepSpeed's MoE layers: experts saved by global index -----------------------------------------------------
def _ds_net(ep: int):
    import bunsan.deepspeed as deepspeed
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), deepspeed.moe.layer.MoE(
        hidden_size=16, expert=nn.Linear(16, 16), num_experts=4, ep_size=ep, k=2, min_capacity=0,
        top2_2nd_expert_sampling=False))


class _Net(nn.Module):
    def __init__(self, ep: int):
        super().__init__()
        self.body = _ds_net(ep)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h, _, _ = self.body[1](F.relu(self.body[0](x)))
        return self.head(h)


def _ds_step(engine, rank: int, step: int):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)
    loss = F.cross_entropy(engine(x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _ds(rank: int, ep: int, path: str, save: bool):
    import bunsan.deepspeed as deepspeed
    engine, _, _, _ = deepspeed.initialize(model=_Net(ep), config={
        "train_batch_size": 16, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "train": {"timeout_s": 60}})
    if save:
        for s in range(2):
            _ds_step(engine, rank, s)
        engine.save_checkpoint(path)
    else:
        engine.load_checkpoint(path)
    return _ds_step(engine, rank, 2), to_numpy(engine.bunsan.consolidated_state_dict())


def test_deepspeed_moe_experts_are_saved_by_global_index_and_read_at_another_ep_size(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools.run(2, _ds, 2, path, True)
    resumed = pools.run(2, _ds, 1, path, False)
    assert "body.1.deepspeed_moe.experts.deepspeed_experts.3.weight" in saved[0][1]
    for (loss, state), (want_loss, want_state) in zip(resumed, saved):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        for key, want in want_state.items():
            torch.testing.assert_close(torch.from_numpy(state[key]), torch.from_numpy(want), rtol=1e-5, atol=1e-6,
                                       msg=key)
