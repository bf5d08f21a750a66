"""ZeRO-2/3 under pipeline stages: what each rank gathers and holds (the parity of these layouts is in
test_parity_sgd.py and test_checkpoint.py). ZeRO-3 gathers a stage's blocks once per micro-batch's forward
and backward (`stage3_pipeline_gather: micro_batch`) or once for the whole schedule (`schedule`); gradients are
reduced once, after the schedule."""

from __future__ import annotations

import pytest

from parity import batches, rank_slice, tiny_model

MICRO = 4


def _cfg(stage: int, gather: str = "micro_batch") -> dict:
    return {"train_batch_size": 8, "gradient_accumulation_steps": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "pipeline": {"stages": 2, "schedule": "1f1b"}, "train": {"timeout_s": 60},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                  "stage3_pipeline_gather": gather}}


def _gathers(rank, world, gather):
    import bunsan
    engine = bunsan.initialize(tiny_model(0, num_hidden_layers=4), _cfg(3, gather))
    dp = engine.strategy
    blocks = [k for k in range(len(dp.units)) if k != len(dp.units) - 1]
    counts, live = {k: 0 for k in blocks}, [0]
    launch = dp._launch_gather

    def counted(k):
        if k in counts:
            counts[k] += 1
        out = launch(k)
        live[0] = max(live[0], sum(dp.units[j].gathered or dp.units[j].pending is not None for j in blocks) + 1)
        return out

    dp._launch_gather = counted
    engine.train_batch(rank_slice(batches(1, 8)[0], engine.dp_rank, engine.dp_size))
    held_after = [dp.units[k].gathered for k in blocks]
    return counts, live[0], held_after, len(blocks)


@pytest.mark.parametrize("gather", ["micro_batch", "schedule"])
def test_zero3_gathers_a_stage_per_micro_batch_or_once(pools, gather):
    for counts, live, held_after, n_blocks in pools.run(4, _gathers, 4, gather):
        assert n_blocks == 2                               # 4 layers over 2 stages: each stage's own units
        if gather == "micro_batch":
            assert all(c == 2 * MICRO for c in counts.values()), counts    # each micro-batch's forward, backward
            assert live <= 2                              # a block and the next one's prefetch
        else:
            assert all(c == 1 for c in counts.values()), counts
            assert live == n_blocks
        assert not any(held_after)                        # between steps: shards only


def _zero2_grads(rank, world):
    import bunsan
    engine = bunsan.initialize(tiny_model(0), _cfg(2))
    engine.train_batch(rank_slice(batches(1, 8)[0], engine.dp_rank, engine.dp_size))
    return [p.grad is None for p in engine.module.parameters()], engine.strategy.bytes_by_kind()["grads"]


def test_zero2_frees_whole_gradients_after_the_schedule(pools):
    for freed, grad_bytes in pools.run(4, _zero2_grads, 4):
        assert all(freed)                                 # reduce-scattered once, then freed
        assert grad_bytes > 0                             # the fp32 shard until zero_grad
