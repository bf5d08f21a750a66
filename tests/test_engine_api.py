"""The engine's small public surface the rest of bunsan relies on: state_dict for checkpoints, one batch
contract for every layout, and a strategy interface every ZeRO stage implements in full."""

from __future__ import annotations

import inspect

import pytest
import torch

import bunsan
from bunsan.zero.stage0 import Replicated
from bunsan.zero.stage12 import Stage1, Stage2
from bunsan.zero.stage3 import FullyShardedDP
from bunsan.zero.strategy import Strategy
from parity import batches, tiny_model

CFG = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
       "fp16": {"enabled": False}}


@pytest.mark.parametrize("cls", [Replicated, Stage1, Stage2, FullyShardedDP])
def test_every_strategy_implements_the_whole_interface(cls):
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented"
    assert issubclass(cls, Strategy)


def test_engine_state_dict_round_trips_counters_and_the_schedule():
    engine = bunsan.initialize(tiny_model(), {**CFG, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}}})
    for b in batches(3, 4):
        engine.train_batch(b)
    state = engine.state_dict()
    assert state == {"global_step": 3, "skipped_steps": 0, "scaler": None}
    lr = engine.lr
    other = bunsan.initialize(tiny_model(), {**CFG, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}}})
    other.load_state_dict(state)
    assert other.global_step == 3 and other.lr == pytest.approx(lr) and lr > 0


def test_state_dict_refuses_the_middle_of_a_step():
    engine = bunsan.initialize(tiny_model(), CFG)
    b = batches(1, 2)[0]
    loss = torch.nn.functional.cross_entropy(engine(b["input_ids"]).flatten(0, 1), b["labels"].flatten())
    engine.backward(loss)
    engine.step()
    assert engine.micro_steps == 1
    with pytest.raises(RuntimeError, match="middle of an optimizer step"):
        engine.state_dict()


def test_fp16_scaler_state_is_in_the_engine_state():
    engine = bunsan.initialize(tiny_model(), {**CFG, "fp16": {"enabled": True, "initial_scale_power": 8}})
    engine.train_batch(batches(1, 4)[0])
    scaler = engine.state_dict()["scaler"]
    assert scaler["scale"] == engine.loss_scale and set(scaler) >= {"scale", "cur_hysteresis", "iter"}


def test_a_batch_key_the_model_is_not_fed_is_refused_not_dropped():
    engine = bunsan.initialize(tiny_model(), CFG)
    b = batches(1, 4)[0]
    with pytest.raises(ValueError, match=r"\['attention_mask'\] would be ignored"):
        engine.train_batch({**b, "attention_mask": torch.ones_like(b["input_ids"])})
    with pytest.raises(ValueError, match=r"missing \['labels'\]"):
        engine.eval_batch({"input_ids": b["input_ids"]})


def test_eval_of_a_loss_fn_weighs_rows():
    """A loss_fn's mean per batch: evaluation returns the mean over rows."""
    model = torch.nn.Linear(4, 1)
    engine = bunsan.initialize(model, {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                               loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(5, 4), torch.randn(5, 1)
    with torch.no_grad():
        expect = torch.nn.functional.mse_loss(model(x), y).item()
    assert engine.eval_batch((x, y)) == pytest.approx(expect, rel=1e-6)
