"""Pipeline parallelism against the plain single-process loop: every schedule, PP x DP, PP x TP and 2 x 2 x 2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bunsan
from parity import (Setup, assert_parity, batches, optimizer_config, reference_for, reference_train, tiny_model,
                    to_numpy, train)

STEPS, ROWS, SEQ = 2, 8, 16
SETUP = Setup(steps=STEPS, rows=ROWS, seq=SEQ)


def _cfg(pp, schedule, m, dp=1, tp=1, v=1, stage=0, clip=1.0, partition="uniform", sp=False):
    return {"train_micro_batch_size_per_gpu": ROWS // (dp * m), "gradient_accumulation_steps": m,
            "optimizer": optimizer_config("sgd"), "gradient_clipping": clip,
            "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v, "partition": partition},
            "tensor_parallel": {"size": tp, "sequence_parallel": sp}, "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000}}


def _check(pools, world, cfg, setup=SETUP):
    """Train `cfg` on `world` ranks, compare with the plain loop (the config's SGD and clipping); the runs."""
    runs = pools.run(world, train, world, cfg, setup)
    assert_parity(runs, reference_for(cfg, setup))
    return runs


CASES = [(2, "gpipe", 2, 1), (2, "1f1b", 4, 1), (2, "interleaved", 4, 2),
         (4, "gpipe", 4, 1), (4, "1f1b", 8, 1), (4, "interleaved", 4, 2)]


# Clipped: the global norm over stages is checked. Without clipping (where a uniform gradient-scale error, a
# mean over the wrong count of micro-batches or stages, shows; clipping to 1 rescales it away), the same
# layouts and compositions: test_parity_sgd.py.
@pytest.mark.parametrize("pp,schedule,m,v", CASES)
def test_pipeline_matches_single_process(pools, pp, schedule, m, v):
    overrides = {"num_hidden_layers": 8} if pp * v > 4 else {}
    _check(pools, pp, _cfg(pp, schedule, m, v=v), SETUP.replace(overrides=overrides))


def test_tied_embeddings_across_stages_stay_tied(pools):
    runs = _check(pools, 2, _cfg(2, "1f1b", 4), SETUP.replace(overrides={"tie_word_embeddings": True}, local=True))
    first, last = (r.local for r in sorted(runs, key=lambda r: r.pp_rank))
    np.testing.assert_array_equal(first["embed_tokens.weight"], last["lm_head.weight"])


def test_meta_model_materialises_only_its_stage(pools):
    runs = _check(pools, 2, _cfg(2, "1f1b", 2), SETUP.replace(build="meta"))     # weights drawn by name
    total = sum(p.numel() for p in tiny_model().parameters())
    held = [r.held for r in runs]
    assert sum(held) == total and max(held) < 0.7 * total


def _user_model_after_setup(rank, world):
    model = tiny_model(tie_word_embeddings=True)
    engine = bunsan.initialize(model, _cfg(2, "1f1b", 2))
    return engine.pp_rank, {name: prm.is_meta for name, prm in model.named_parameters(remove_duplicate=False)}


def test_the_callers_model_releases_the_other_stages_weights(pools):
    # A script keeps its model; the layers another rank runs must not stay allocated beside this rank's stage.
    # The tied head's weight is the first stage's embedding: both ends keep it.
    for pp_rank, meta in pools.run(2, _user_model_after_setup, 2):
        own, other = ("layers.0.", "layers.3.") if pp_rank == 0 else ("layers.3.", "layers.0.")   # 4 blocks
        assert not meta["embed_tokens.weight"] and not meta["lm_head.weight"]
        assert all(is_meta for name, is_meta in meta.items() if name.startswith(other)), (pp_rank, meta)
        assert not any(is_meta for name, is_meta in meta.items() if name.startswith(own)), (pp_rank, meta)


@pytest.mark.parametrize("name,pp,dp,tp,stage,sp", [
    ("pp2_dp2_zero1", 2, 2, 1, 1, False), ("pp2_dp2_zero0", 2, 2, 1, 0, False), ("pp2_tp2", 2, 1, 2, 0, False),
    ("pp2_tp2_sp", 2, 1, 2, 0, True), ("pp2_dp2_tp2_zero1", 2, 2, 2, 1, False)])
def test_pipeline_composes(pools, name, pp, dp, tp, stage, sp):
    _check(pools, pp * dp * tp, _cfg(pp, "1f1b", 2, dp=dp, tp=tp, stage=stage, sp=sp),
           SETUP.replace(overrides={"tie_word_embeddings": True}))


def _eval_and_errors(rank, world):
    out = {}
    for name, cfg in (("few_micro", _cfg(2, "1f1b", 1)), ("interleaved_indivisible", _cfg(2, "interleaved", 3, v=2))):
        cfg["train_micro_batch_size_per_gpu"] = 2
        try:
            bunsan.initialize(tiny_model(), cfg)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    engine = bunsan.initialize(tiny_model(), _cfg(2, "1f1b", 4))
    try:
        engine(torch.zeros(1, 4, dtype=torch.long))
    except RuntimeError as e:
        out["loop"] = str(e)
    out["eval"] = engine.eval_batch(batches(1, ROWS, SEQ)[0])
    return out


def test_pipeline_errors_and_evaluation(pools):
    out = pools.run(2, _eval_and_errors, 2)[0]
    assert "gradient_accumulation_steps" in out["few_micro"] and "stages" in out["few_micro"]
    assert "gradient_accumulation_steps" in out["interleaved_indivisible"]
    assert "engine.train_batch(batch)" in out["loop"]
    model, b = tiny_model(), batches(1, ROWS, SEQ)[0]
    with torch.no_grad():
        logits = model(b["input_ids"])
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), b["labels"].reshape(-1))
    assert out["eval"] == pytest.approx(ref.item(), rel=1e-5)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def _mlp_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def _train_sequential(rank, world, schedule):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": optimizer_config("sgd"), "pipeline": {"stages": 2, "schedule": schedule}}
    engine = bunsan.initialize(_mlp(), cfg, loss_fn=torch.nn.functional.mse_loss)
    losses = [engine.train_batch(b) for b in _mlp_data()]
    return losses, to_numpy(engine.consolidated_state_dict())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_any_sequential_model_with_its_own_loss(pools, schedule):
    # 4 micro-batches of 2 rows: the mean of their mean losses
    ref = reference_train(_mlp(), _mlp_data(), "sgd", loss_fn=torch.nn.functional.mse_loss, micro=4)
    assert_parity(pools.run(2, _train_sequential, 2, schedule), ref)


def _train_mixed(rank, world, precision):
    cfg = _cfg(2, "1f1b", 4)
    cfg[precision] = {"enabled": True}
    engine = bunsan.initialize(tiny_model(), cfg)
    dtypes = {p.dtype for p in engine.module.parameters()}
    losses = [engine.train_batch(b) for b in batches(STEPS, ROWS, SEQ)]
    return losses, [str(d) for d in dtypes], engine.loss_scale


@pytest.mark.parametrize("precision,dtype", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_mixed_precision_activations_cross_stages(pools, precision, dtype):
    """16-bit activations and gradients travel between stages (the message header carries the dtype); fp16
    scales the loss on the last stage. Losses track the fp32 loop within 16-bit rounding."""
    ref_losses, _ = reference_train(tiny_model(), SETUP.data(), "sgd", 1.0)
    for losses, dtypes, scale in pools.run(2, _train_mixed, 2, precision):
        assert dtypes == [dtype]
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
        assert scale == (1.0 if precision == "bf16" else 2.0 ** 16)


def _inplace_mlp(seed=0):
    torch.manual_seed(seed)   # stage 1 (uniform: two layers a stage) starts with an in-place ReLU
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True),
                               torch.nn.Linear(16, 4))


def _train_inplace(rank, world):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
           "optimizer": optimizer_config("sgd"), "pipeline": {"stages": 2, "schedule": "1f1b"}}
    engine = bunsan.initialize(_inplace_mlp(), cfg, loss_fn=torch.nn.functional.mse_loss)
    losses = [engine.train_batch(b) for b in _mlp_data()]
    return losses, to_numpy(engine.consolidated_state_dict())


def test_a_stage_whose_first_layer_works_in_place(pools):
    """A received activation collects its gradient: the stage computes on a copy of it, as DeepSpeed does."""
    ref = reference_train(_inplace_mlp(), _mlp_data(), "sgd", loss_fn=torch.nn.functional.mse_loss, micro=4)
    assert_parity(pools.run(2, _train_inplace, 2), ref)
