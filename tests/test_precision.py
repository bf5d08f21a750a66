"""fp16 loss scaler (DeepSpeed semantics), bf16 against a replay with the same casts, activation checkpointing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import bunsan
from bunsan.engine.precision import LossScaleError, LossScaler
from parity import ADAM_EPS, assert_parity, batches, bf16_replay, rank_slice, tiny_model, to_numpy


# -- the loss scaler ---------------------------------------------------------------------------------
def test_overflow_with_hysteresis_halves_only_after_the_second_overflow():
    s = LossScaler(initial_scale_power=16, loss_scale_window=1000, hysteresis=2)
    s.update(True)
    assert s.scale == 2**16 and s.skipped_steps == 1   # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 2**15                             # second one halves
    s.update(True)
    assert s.scale == 2**14                             # hysteresis is used up until a window passes


def test_growth_after_a_window_of_clean_steps_restores_hysteresis():
    s = LossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    for _ in range(2):
        s.update(False)
    assert s.scale == 16
    s.update(False)
    assert s.scale == 32                                # 3 clean steps
    s.update(True)
    s.update(True)
    assert s.scale == 16
    for _ in range(2):
        s.update(False)
    assert s.scale == 16
    s.update(False)                                     # window counted from the last overflow
    assert s.scale == 32 and s.cur_hysteresis == 2


def test_minimum_scale_is_a_clear_error():
    s = LossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    s.update(True)
    assert s.scale == 1.0
    with pytest.raises(LossScaleError, match="minimum loss scale 1"):
        s.update(True)


def test_static_scale_never_moves():
    s = LossScaler(static_scale=128.0)
    for overflow in (True, False, True):
        s.update(overflow)
    assert s.scale == 128.0 and s.skipped_steps == 2


def test_consecutive_hysteresis_refills_on_every_clean_step():
    s = LossScaler(initial_scale_power=8, hysteresis=2, consecutive_hysteresis=True)
    s.update(True)
    s.update(False)
    s.update(True)
    assert s.scale == 2**8                              # refilled, so absorbed again


# -- engine runs in 16-bit ---------------------------------------------------------------------------
# Adam's eps at 1e-5, not 1e-8: an element whose gradient is at the noise floor moves by about lr whatever its
# sign, so with 1e-8 a last-bit difference anywhere in the step (kernels that round differently on another CPU)
# is amplified into lr-sized weight differences, even where the reduced bf16 gradients are bit-identical to
# the replay's.


def _bf16_engine(rank, world):
    engine = bunsan.initialize(tiny_model(), {"train_micro_batch_size_per_gpu": 8 // world, "bf16": {"enabled": True},
                                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": ADAM_EPS}},
                                              "gradient_clipping": 1.0})
    assert engine.module.embed_tokens.weight.dtype == torch.bfloat16 and engine.strategy.master.dtype == torch.float32
    losses = [engine.train_batch(rank_slice(b, rank, world)) for b in batches(3, 8)]
    mem = engine.memory_report()
    return losses, to_numpy(engine.consolidated_state_dict()), mem


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_matches_the_replayed_casts(pools, world):
    ref_losses, ref_state = bf16_replay(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=ADAM_EPS),
                                        batches(3, 8), world, clip=1.0)
    runs = pools.run(world, _bf16_engine, world)
    assert_parity(runs, (ref_losses, ref_state))
    for _, _, mem in runs:
        psi = sum(v.size for v in ref_state.values())
        assert mem["params"] == 2 * psi and mem["grads"] == 2 * psi and mem["master_weights"] == 4 * psi
        assert mem["optimizer_states"] == 8 * psi and mem["model_states"] == mem["theory_model_states"]


def _fp16_engine(rank, world):
    engine = bunsan.initialize(tiny_model(), {"train_micro_batch_size_per_gpu": 4, "fp16": {
        "enabled": True, "initial_scale_power": 32, "hysteresis": 1}})
    losses = [engine.train_batch(rank_slice(b, rank, world)) for b in batches(6, 8)]
    return losses, engine.loss_scale, engine.skipped_steps, engine.global_step


def test_fp16_skips_overflowing_steps_and_learns(pools):
    """2**32 overflows fp16 at once: steps are skipped and the scale halves until the gradients fit."""
    for losses, scale, skipped, step in pools.run(2, _fp16_engine, 2):
        assert skipped >= 1 and scale < 2**32 and step == 6
        assert all(np.isfinite(losses))


# -- activation checkpointing ------------------------------------------------------------------------
def test_activation_checkpointing_gives_the_same_gradients():
    b = batches(1, 4)[0]
    grads = []
    for ckpt in (False, True):
        model = tiny_model()
        if ckpt:
            assert bunsan.apply_activation_checkpointing(model) == len(model.layers)
        loss = F.cross_entropy(model(b["input_ids"]).reshape(-1, 256), b["labels"].reshape(-1))
        loss.backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
        keys = list(model.state_dict())
    assert keys == list(tiny_model().state_dict())     # names unchanged by the transform
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=0, atol=0)


def _ckpt_engine(rank, world):
    engine = bunsan.initialize(tiny_model(), {"train_micro_batch_size_per_gpu": 4,
                                              "activation_checkpointing": {"enabled": True}})
    return [engine.train_batch(rank_slice(b, rank, world)) for b in batches(2, 8)]


def test_activation_checkpointing_in_the_engine(pools):
    plain = [F.cross_entropy(tiny_model()(b["input_ids"]).reshape(-1, 256), b["labels"].reshape(-1)).item()
             for b in batches(1, 8)]
    losses = pools.run(2, _ckpt_engine, 2)
    np.testing.assert_allclose(losses[0][0], plain[0], rtol=1e-5)
