"""Data parallelism (ZeRO stage 0) against the plain single-process loop: fp32, rtol 1e-5."""

from __future__ import annotations

import pytest
import torch

import bunsan
from parity import (Setup, assert_parity, assert_same_on_every_rank, batches, optimizer_config, rank_slice,
                    reference_train, tiny_model, to_numpy, train)

STEPS, ROWS = 3, 8


def _cfg(world, grad_accum, opt_name, clip, overlap=True, bucket=2000):
    return {"train_micro_batch_size_per_gpu": ROWS // world // grad_accum, "gradient_accumulation_steps": grad_accum,
            "optimizer": optimizer_config(opt_name), "gradient_clipping": clip,
            "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket, "overlap_comm": overlap}}


def _setup(ignore_frac=0.0):
    return Setup(steps=STEPS, rows=ROWS, ignore_frac=ignore_frac)


def _train(pools, world, grad_accum, opt_name, clip, ignore_frac=0.0, **kw):
    return pools.run(world, train, world, _cfg(world, grad_accum, opt_name, clip, **kw), _setup(ignore_frac))


def _check(runs, opt_name, clip, ignore_frac=0.0):
    assert_parity(runs, reference_train(tiny_model(), _setup(ignore_frac).data(), opt_name, clip))
    assert_same_on_every_rank(runs)      # every rank returns the same number (and, above, the same weights)


@pytest.mark.parametrize("world,grad_accum,opt_name,clip", [
    (1, 1, "adamw", 0.0),
    (2, 1, "adamw", 0.0),
    (2, 1, "sgd", 1.0),
    (4, 1, "adamw", 1.0),
    (4, 1, "sgd", 0.0),
    (1, 4, "adamw", 1.0),   # accumulation 4 x b == 1 x 4b
    (1, 4, "sgd", 0.0),
    (2, 2, "adamw", 0.5),
])
def test_dp_matches_single_process(pools, world, grad_accum, opt_name, clip):
    _check(_train(pools, world, grad_accum, opt_name, clip), opt_name, clip)


def test_ignored_labels_give_the_global_token_mean(pools):
    """Ranks with different numbers of -100 labels still reproduce the mean over all tokens."""
    _check(_train(pools, 2, 2, "adamw", 0.0, 0.3), "adamw", 0.0, 0.3)


def test_no_overlap_and_one_bucket_give_the_same_result(pools):
    _check(_train(pools, 2, 1, "adamw", 1.0, overlap=False, bucket=10**9), "adamw", 1.0)


def test_allreduce_bytes_follow_the_ring_formula(pools):
    runs = _train(pools, 4, 2, "adamw", 0.0)
    n_params = sum(p.numel() for p in tiny_model().parameters())
    grad_bytes = 4 * n_params
    for run in runs:
        step = run.comm["step"]
        ar = step["all_reduce/dp"]
        scalar_bytes = 2 * 2 * 3 * 8 // 4  # two float64 scalar all-reduces per step (token count, loss)
        assert ar["bytes"] == 2 * 3 * grad_bytes // 4 + scalar_bytes
        assert ar["calls"] >= 2 + 1  # at least one bucket besides the two scalars


def _deepspeed_style(rank, world):
    torch.manual_seed(0)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = bunsan.initialize(model=model, optimizer=opt, config={
        "train_batch_size": ROWS, "gradient_accumulation_steps": 2})
    assert type(engine.optimizer) is torch.optim.SGD and engine.optimizer.defaults["momentum"] == 0.9
    losses = []
    for b in batches(STEPS, ROWS):
        mine = rank_slice(b, rank, world)
        for mb in (rank_slice(mine, 0, 2), rank_slice(mine, 1, 2)):
            logits = engine(mb["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), mb["labels"].reshape(-1))
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert engine.global_step == STEPS
    return to_numpy(engine.consolidated_state_dict())


def test_deepspeed_style_loop_with_user_optimizer(pools):
    """engine(x) / backward / step with a user-built optimizer equals the plain loop (equal-size micro-batches)."""
    _, ref_state = reference_train(tiny_model(), batches(STEPS, ROWS), "sgd", 0.0)
    assert_parity([(None, state) for state in pools.run(2, _deepspeed_style, 2)], (None, ref_state))
