"""LoRA under every layout bunsan runs it with, against the plain single-process loop over the same adapters:
tensor parallel (adapters split with their base layer, with and without sequence parallelism), pipeline
stages, TP x DP with ZeRO, and ZeRO-3 (the frozen base sharded too)."""

from __future__ import annotations

import numpy as np
import pytest

import bunsan
from parity import (Setup, assert_parity, batches, optimizer_config, rank_slice, reference_for, tiny_model,
                    to_numpy, train)

pytest.importorskip("peft")

STEPS, ROWS, SEQ = 3, 8, 16
SETUP = Setup(steps=STEPS, rows=ROWS, seq=SEQ)
LORA = {"enabled": True, "r": 4, "alpha": 8.0, "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]}


def _cfg(tp=1, sp=False, dp=1, pp=1, m=1, stage=0, clip=1.0):
    return {"train_micro_batch_size_per_gpu": ROWS // (dp * m), "gradient_accumulation_steps": m,
            "optimizer": optimizer_config("sgd"), "gradient_clipping": clip, "lora": LORA,
            "tensor_parallel": {"size": tp, "sequence_parallel": sp},
            "pipeline": {"stages": pp, "schedule": "1f1b"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000,
                                  "stage3_param_persistence_threshold": 0}, "train": {"timeout_s": 60}}


def _setup(cfg):      # pipeline stages build on meta: each materialises its own layers, drawn by name
    return SETUP.replace(build="meta" if cfg["pipeline"]["stages"] > 1 else "plain")


def _train(pools, world, cfg):
    return pools.run(world, train, world, cfg, _setup(cfg))


CASES = {"tp2": dict(tp=2), "tp2-sp": dict(tp=2, sp=True), "pp2": dict(pp=2, m=2),
         "tp2-dp2-zero1": dict(tp=2, dp=2, stage=1), "dp2-zero3": dict(dp=2, stage=3),
         "tp2-dp2-zero3": dict(tp=2, dp=2, stage=3)}


# Clipped here; without clipping (a uniform gradient-scale error shows), these layouts and LoRA on plain DP:
# test_parity_sgd.py.
@pytest.mark.parametrize("name", list(CASES))
def test_lora_layout_matches_single_process(pools, name):
    kw = CASES[name]
    world = kw.get("tp", 1) * kw.get("dp", 1) * kw.get("pp", 1)
    cfg = _cfg(**kw)
    results = _train(pools, world, cfg)
    ref_losses, ref_state = reference_for(cfg, _setup(cfg))      # the same adapters, drawn the same way
    assert any(".lora_A." in k for k in ref_state) and any(".base_layer." in k for k in ref_state)
    assert_parity(results, (ref_losses, ref_state))
    # the estimator prices every rank's model states as held: adapters split or whole, base frozen (and sharded)
    from bunsan.estimator import estimate
    est = estimate(tiny_model(), cfg, gpus=world, device_type="cpu")
    for run in results:
        want = est.stage_states[run.pp_rank]["model_states"]
        assert run.memory["model_states"] == pytest.approx(want, rel=0.03), name
    # the adapters did train, and the frozen base did not
    base = tiny_model().state_dict() if kw.get("pp", 1) == 1 else None
    for state in (run.state for run in results[:1]):
        assert any(np.abs(state[k]).max() > 0 for k in ref_state if ".lora_B." in k)
        if base is not None:
            w = "layers.0.self_attn.q_proj.base_layer.weight"
            np.testing.assert_array_equal(state[w], base["layers.0.self_attn.q_proj.weight"].numpy())


def test_tensor_parallel_splits_the_adapters(pools):
    """Each TP rank holds half of every adapter that is split (B of a column layer, A of a row layer)."""
    tp_results = _train(pools, 2, _cfg(tp=2))
    one = _train(pools, 1, _cfg())[0]
    split = {"q_proj", "v_proj", "gate_proj"}                     # column: B split, A whole
    from bunsan.config.root import Config
    from bunsan.transforms.lora import apply_lora
    model = tiny_model()
    apply_lora(model, Config.load({"lora": LORA}).lora)
    full = one.trainable
    per_rank = tp_results[0].trainable
    # column layers: A (r x hidden) whole, B (out x r) halved; row layers: A halved, B whole
    half = 0
    for name, p in model.named_parameters():
        if ".lora_" in name:
            mod = name.split(".")[-4]
            if (mod in split and ".lora_B." in name) or (mod not in split and ".lora_A." in name):
                half += p.numel() // 2
    assert half > 0 and per_rank == full - half


def _save(rank, world, cfg, path):
    engine = bunsan.initialize(tiny_model(), cfg)
    for b in batches(STEPS, ROWS, SEQ):
        engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size))
    engine.save_checkpoint(path)
    return to_numpy(engine.consolidated_state_dict())


def _load(rank, world, cfg, path):
    engine = bunsan.initialize(tiny_model(seed=7), cfg)           # other weights: all must come from the file
    engine.load_checkpoint(path)
    loaded = to_numpy(engine.consolidated_state_dict())
    loss = engine.train_batch(rank_slice(batches(1, ROWS, SEQ, seed=9)[0], engine.dp_rank, engine.dp_size))
    return to_numpy(engine.consolidated_state_dict()), loss, loaded


@pytest.mark.parametrize("saved,loaded", [("dp2-zero3", "tp2"), ("tp2", "dp2-zero3")])
def test_lora_checkpoint_moves_between_layouts(pools, tmp_path, saved, loaded):
    """A LoRA run's checkpoint (sharded frozen base and adapters, or TP-split ones) resumes on another layout."""
    world = {"dp2-zero3": 2, "tp2": 2}
    state = pools.run(world[saved], _save, world[saved], _cfg(**CASES[saved]), str(tmp_path / "ck"))[0]
    again = pools.run(world[loaded], _load, world[loaded], _cfg(**CASES[loaded]), str(tmp_path / "ck"))
    ref = pools.run(world[saved], _load, world[saved], _cfg(**CASES[saved]), str(tmp_path / "ck"))[0]
    for _, _, loaded_state in again:                 # what was saved is what any layout loads
        assert loaded_state.keys() == state.keys()
        for k, v in state.items():
            np.testing.assert_array_equal(loaded_state[k], v, err_msg=k)
    # and one more step agrees with the saving layout's
    assert_parity([([loss], got) for got, loss, _ in again], ([ref[1]], ref[0]))


def _from_hf(rank, world, cfg, hf_dir):
    from bunsan.checkpoint.hf import load_hf_into_engine
    engine = bunsan.initialize(tiny_model(seed=7), cfg)
    load_hf_into_engine(engine, hf_dir)
    return to_numpy(engine.consolidated_state_dict())


@pytest.mark.parametrize("name", ["dp2-zero3", "tp2"])
def test_lora_fine_tunes_a_hugging_face_model(pools, tmp_path, name):
    """--init-from a HF Llama with LoRA: base weights come from the file (as `base_layer`), adapters start fresh."""
    from bunsan.models.hf import save_llama
    model = tiny_model(seed=3)
    save_llama(model.state_dict(), model.config, tmp_path / "hf")
    world = 2
    for state in pools.run(world, _from_hf, world, _cfg(**CASES[name]), str(tmp_path / "hf")):
        for k, v in model.state_dict().items():
            np.testing.assert_array_equal(state[k.replace(".q_proj.", ".q_proj.base_layer.")
                                                 .replace(".v_proj.", ".v_proj.base_layer.")
                                                 .replace(".o_proj.", ".o_proj.base_layer.")
                                                 .replace(".gate_proj.", ".gate_proj.base_layer.")
                                                 .replace(".down_proj.", ".down_proj.base_layer.")], v.numpy(), err_msg=k)
        assert all(not np.any(state[k]) for k in state if ".lora_B." in k)
        assert all(np.any(state[k]) for k in state if ".lora_A." in k)
