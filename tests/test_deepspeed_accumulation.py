"""accelerate's way of driving a DeepSpeed engine (transformers' Trainer goes through it): before each backward
`set_gradient_accumulation_boundary(sync)`, the loss already divided by the caller (`scale_wrt_gas=False`), and
`step()` only on the micro-batch that ends a step, whose length the caller decides (an epoch's last accumulation
is shorter than gradient_accumulation_steps).

2 ranks against a plain loop in one process over the same groups of micro-batches: SGD without clipping (a
uniform gradient-scale error shows), fp32 rtol 1e-5, every ZeRO stage. bf16 (which transformers' Trainer does
not reach on a CPU) against the engine's own counted accumulation over the same micro-batches, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

GROUPS = [2, 2, 1, 2, 2, 1]     # micro-batches per step: two epochs of 5 micro-batches at accumulation 2
LR = 0.1


def _data(micro_batches: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(micro_batches, 2, 3, 6, generator=g), torch.randn(micro_batches, 2, 3, 4, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _config(stage: int, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16}}


def _weights(engine) -> dict[str, torch.Tensor]:
    import bunsan.deepspeed as deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _accelerate_rank(rank: int, stage: int, bf16: bool, groups: list[int], x, y):
    """The loop accelerate runs for the Trainer (accelerate/utils/deepspeed.py, DeepSpeedEngineWrapper)."""
    import bunsan.deepspeed as deepspeed
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage, bf16))
    dtype = torch.bfloat16 if bf16 else torch.float32
    i, losses, boundaries = 0, [], []
    for n in groups:
        for k in range(n):
            engine.set_gradient_accumulation_boundary(k == n - 1)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            loss = F.mse_loss(engine(x[i][rank].to(dtype)).float(), y[i][rank]) / n   # the caller's scaling
            engine.backward(loss, scale_wrt_gas=False)
            if k == n - 1:
                engine.step()
            losses.append(loss.item() * n)
            i += 1
    return losses, boundaries, engine.global_steps, _weights(engine)


def _counted_rank(rank: int, stage: int, bf16: bool, micro_batches: int, x, y):
    """DeepSpeed's own loop: backward and step every micro-batch, the engine counting to the boundary."""
    import bunsan.deepspeed as deepspeed
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage, bf16))
    dtype = torch.bfloat16 if bf16 else torch.float32
    losses = []
    for i in range(micro_batches):
        loss = F.mse_loss(engine(x[i][rank].to(dtype)).float(), y[i][rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.global_steps, _weights(engine)


def _plain(groups: list[int], x, y):
    """One process: each step's gradient is the mean over ranks of the mean over its micro-batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    i, losses = 0, [[], []]
    for n in groups:
        opt.zero_grad()
        total = 0
        for _ in range(n):
            for r in range(2):
                loss = F.mse_loss(model(x[i][r]), y[i][r])
                losses[r].append(loss.item())
                total = total + loss / (n * 2)
            i += 1
        total.backward()
        opt.step()
    return losses, model.state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accelerates_boundaries_step_where_it_says_with_its_loss_scale(pools, stage):
    x, y = _data(sum(GROUPS))
    results = pools.run(2, _accelerate_rank, stage, False, GROUPS, x, y)
    want_losses, want_weights = _plain(GROUPS, x, y)
    expected_boundaries = [k == n - 1 for n in GROUPS for k in range(n)]
    for r, (losses, boundaries, steps, weights) in enumerate(results):
        assert boundaries == expected_boundaries
        assert steps == len(GROUPS)
        assert losses == pytest.approx(want_losses[r], rel=1e-5)
        for k, w in want_weights.items():
            torch.testing.assert_close(weights[k], w, rtol=1e-5, atol=1e-7, msg=f"rank {r} stage {stage}: {k}")


@pytest.mark.parametrize("stage", [0, 3])
def test_in_bf16_accelerates_boundaries_equal_the_counted_accumulation(pools, stage):
    """Even groups (accumulation 2 throughout): the caller's loss / 2 is the engine's own loss / 2, so the two
    loops run the same operations on bf16 weights and an fp32 master copy."""
    groups = [2, 2, 2]
    x, y = _data(sum(groups))
    told = pools.run(2, _accelerate_rank, stage, True, groups, x, y)
    counted = pools.run(2, _counted_rank, stage, True, sum(groups), x, y)
    for (losses, _, steps, weights), (want_losses, want_steps, want_weights) in zip(told, counted):
        assert steps == want_steps == len(groups)
        assert losses == want_losses
        for k in want_weights:
            assert torch.equal(weights[k], want_weights[k]), k


def test_zero_grad_inside_an_accumulation_accelerate_drives_is_refused():
    """With accelerate's boundaries no step() comes between the micro-batches of a step: zero_grad() there would
    drop their gradients silently."""
    import bunsan.deepspeed as deepspeed
    engine, *_ = deepspeed.initialize(model=_model(), config=_config(0))
    x, y = _data(2)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(F.mse_loss(engine(x[0][0]), y[0][0]) / 2, scale_wrt_gas=False)
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) after 1 micro-batches"):
        engine.zero_grad()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(F.mse_loss(engine(x[1][0]), y[1][0]) / 2, scale_wrt_gas=False)
    engine.step()
    engine.zero_grad()                   # after the step: nothing is waiting
    assert engine.global_steps == 1
