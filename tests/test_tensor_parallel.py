"""Tensor (and sequence) parallelism against the plain single-process loop; traffic and memory per rank."""

from __future__ import annotations

import pytest
import torch

import bunsan
from parity import (Setup, assert_parity, batches, optimizer_config, rank_slice, reference_train, tiny_model,
                    to_numpy, train)

STEPS, ROWS, SEQ = 3, 8, 32
SETUP = Setup(steps=STEPS, rows=ROWS, seq=SEQ)
KV4 = {"num_key_value_heads": 4}   # tiny has 2 key/value heads: 4 for TP=4


def _cfg(tp, sp, dp, stage=0, opt_name="sgd", clip=1.0):
    return {"train_micro_batch_size_per_gpu": ROWS // dp, "optimizer": optimizer_config(opt_name),
            "gradient_clipping": clip, "tensor_parallel": {"size": tp, "sequence_parallel": sp},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000,
                                  "stage3_param_persistence_threshold": 0}}


def _train(pools, cfg, overrides=None):
    tp, dp = cfg["tensor_parallel"]["size"], ROWS // cfg["train_micro_batch_size_per_gpu"]
    return pools.run(tp * dp, train, tp * dp, cfg, SETUP.replace(overrides=overrides or {}))


def _reference(clip=1.0, overrides=None):
    return reference_train(tiny_model(**(overrides or {})), SETUP.data(), "sgd", clip)


CASES = [(2, False, 1, 0), (2, True, 1, 0), (4, False, 1, 0), (4, True, 1, 0),
         (2, False, 2, 1), (2, True, 2, 1), (2, False, 2, 3), (2, True, 2, 3)]


@pytest.mark.parametrize("tp,sp,dp,stage", CASES)
def test_tensor_parallel_matches_single_process(pools, tp, sp, dp, stage):
    # SGD: its update is linear in the gradient, so any scaling error shows; Adam divides each element by its
    # own magnitude and turns fp32 reduction-order noise in near-zero gradients into lr-sized differences.
    # Clipped here: the global norm over tensor-parallel slices is checked. Unclipped (where a uniform
    # gradient-scale error shows; clipping to 1 rescales it away), the same layouts: test_parity_sgd.py.
    overrides = KV4 if tp == 4 else {}
    assert_parity(_train(pools, _cfg(tp, sp, dp, stage), overrides), _reference(1.0, overrides))


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_with_activation_checkpointing_matches_single_process(pools, sp):
    """Recomputed blocks make their own regions; backward must still reduce through the original ones."""
    assert_parity(_train(pools, {**_cfg(2, sp, 1), "activation_checkpointing": {"enabled": True}}), _reference())


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_traffic_per_block(pools, sp):
    tp, cfg = 2, tiny_model().config
    stats = _train(pools, _cfg(tp, sp, 1, clip=0.0))[0].comm["step"]
    layers, act = cfg.num_hidden_layers, ROWS * SEQ * cfg.hidden_size * 4      # fp32 [b, s, h]
    ring_ar, ring_half = 2 * (tp - 1) / tp, (tp - 1) / tp
    loss_ar = 3 * 4 * ROWS * SEQ * ring_ar           # max, sum-exp and target logit: fp32 [b, s] each
    norm_ar = 8 * ring_ar                             # the gradient norm's float64 scalar
    if not sp:
        # 2 all-reduces forward (o_proj, down_proj) and 2 backward (attention and MLP inputs) per block,
        # plus the embedding's forward and the head input's backward; the loss's three [b, s] reductions; the norm.
        assert stats["all_reduce/tp"]["calls"] == 4 * layers + 2 + 3 + 1
        assert stats["all_reduce/tp"]["bytes"] == pytest.approx((4 * layers + 2) * act * ring_ar + loss_ar + norm_ar,
                                                                rel=1e-6)
        assert "all_gather/tp" not in stats and "reduce_scatter/tp" not in stats
    else:
        # the same points become all-gathers and reduce-scatters of the sequence, half the bytes each; and
        # as in Megatron each parallel region (attention, MLP, the head) saves its input's slice and
        # gathers it again in backward for the weight gradients: one more all-gather per region.
        regions = 2 * layers + 1
        assert stats["reduce_scatter/tp"]["calls"] == 4 * layers + 2
        assert stats["reduce_scatter/tp"]["bytes"] == pytest.approx((4 * layers + 2) * act * ring_half, rel=1e-6)
        assert stats["all_gather/tp"]["calls"] == 4 * layers + 2 + regions
        assert stats["all_gather/tp"]["bytes"] == pytest.approx((4 * layers + 2 + regions) * act * ring_half,
                                                                rel=1e-6)
        norms = 2 * layers + 1       # replicated norm weights: their gradients are summed over the group
        assert stats["all_reduce/tp"]["calls"] == norms + 3 + 1


def test_parameter_bytes_are_split_except_the_norms(pools):
    tp = 2
    model = tiny_model()
    full = {n: p.numel() for n, p in model.named_parameters()}
    norms = sum(v for n, v in full.items() if "norm" in n)
    split = sum(full.values()) - norms
    for run in _train(pools, _cfg(tp, False, 1)):
        assert run.memory["params"] == 4 * (split // tp + norms)


def test_indivisible_heads_are_a_clear_error():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        from bunsan.tensor_parallel.plan import check_llama
        check_llama(tiny_model().config, 4)


def _user_optimizer(rank, world):
    import torch
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine = bunsan.initialize(model, {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 1.0,
                                       "tensor_parallel": {"size": world}}, optimizer=opt)
    losses = [engine.train_batch(b) for b in batches(STEPS, ROWS, SEQ)]
    return losses, to_numpy(engine.consolidated_state_dict())


def test_a_user_optimizer_follows_the_swapped_layers(pools):
    """An optimizer built on the plain model before initialize is re-pointed at the shards, by name."""
    assert_parity(pools.run(2, _user_optimizer, 2), _reference())


def _launches(rank, world, sp):
    engine = bunsan.initialize(tiny_model(), _cfg(2, sp, 1, clip=0.0))
    comm, log = engine.comm, []
    for op in ("all_reduce", "reduce_scatter"):
        def wrapped(*a, _op=op, _inner=getattr(comm, op), **kw):
            group = a[2] if _op == "reduce_scatter" else a[1]
            log.append((_op, group.name, kw.get("async_op", False)))
            return _inner(*a, **kw)
        setattr(comm, op, wrapped)
    engine.train_batch(rank_slice(batches(1, ROWS, SEQ)[0], 0, 1))
    return log


@pytest.mark.parametrize("sp", [False, True])
def test_input_gradient_reductions_overlap_the_weight_gradients(pools, sp):
    """Every backward reduction of a parallel input (attention and MLP per block, the head) is launched
    asynchronously by its last column-split consumer, before that consumer's weight gradient."""
    layers = tiny_model().config.num_hidden_layers
    for log in pools.run(2, _launches, 2, sp):
        op = "reduce_scatter" if sp else "all_reduce"
        assert sum(1 for o, g, a in log if o == op and g == "tp" and a) == 2 * layers + 1, log


class _GatherThenSplit(torch.nn.Module):
    """column_gather feeding row_split_input (transformers' colwise_rep and rowwise_rep)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))

    def forward(self, x):
        return self.block(x)


GATHER_PLAN = {"block": "parallel_input", "block.0": "column_gather", "block.2": "row_split_input"}


def _gather_then_split(rank, world, data):
    engine = bunsan.initialize(_GatherThenSplit(), {"train_batch_size": 4, "tensor_parallel": {"size": 2},
                                                    "optimizer": {"type": "SGD", "params": {"lr": 0.5}}},
                               loss_fn=torch.nn.functional.mse_loss, tp_plan=GATHER_PLAN)
    losses = [engine.train_batch(b) for b in data]
    return losses, engine.consolidated_state_dict()


def test_gathered_column_and_split_input_row_match_a_plain_loop(pools):
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(3)]
    ref = _GatherThenSplit()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    for losses, state in pools.run(2, _gather_then_split, 2, data):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
