"""bunsan's Llama with MoE blocks, the way users reach it: the tiny-moe preset under `bunsan train --ep 2`,
its final directory read by transformers as a Mixtral, its config refused with the field named, and every
expert-parallel layout bunsan does not build refused before any work."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

import bunsan
from bunsan.config.root import Config
from bunsan.models.hf import load_llama, read_config, save_llama
from bunsan.models.llama import Llama, LlamaConfig
from bunsan.models.moe import MoE
from bunsan.models.presets import get_preset

SIGMOID = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 32, "score_func": "sigmoid"}


def test_a_moe_llama_counts_every_parameter_and_its_active_ones():
    cfg = get_preset("tiny-moe")
    model = Llama(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    moe = cfg.moe_config()
    experts = cfg.num_hidden_layers * 3 * cfg.hidden_size * moe.expert_intermediate_size
    assert cfg.num_params() - cfg.num_params(active=True) == experts * (moe.num_experts - moe.top_k)
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers)


def test_tiny_moe_is_a_mixtral_transformers_loads_with_equal_logits(tmp_path):
    import transformers
    torch.manual_seed(0)
    model = Llama(get_preset("tiny-moe")).eval()
    save_llama(model.state_dict(), model.config, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    assert config["router_aux_loss_coef"] == pytest.approx(0.01 * 2)     # transformers' loss is top_k x bunsan's
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
        back = load_llama(tmp_path)
        torch.testing.assert_close(back(ids), model(ids), rtol=0, atol=0)
    assert read_config(tmp_path).moe == model.config.moe


def test_a_transformers_mixtral_directory_loads_into_bunsans_llama(tmp_path):
    import transformers
    hf_cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_llama(tmp_path)
    assert model.config.moe["aux_loss_coef"] == pytest.approx(hf_cfg.router_aux_loss_coef / 2)
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_moe_config_mixtral_cannot_hold_is_refused_when_written_naming_the_field(tmp_path):
    model = Llama(get_preset("tiny").replace(moe=SIGMOID))
    with pytest.raises(ValueError, match="score_func 'sigmoid'"):
        save_llama(model.state_dict(), model.config, tmp_path)


@pytest.mark.parametrize("moe, said", [
    ({"num_expert": 4}, "unknown field(s) num_expert (did you mean 'num_experts'?)"),
    ({"hidden_size": 64}, "unknown field(s) hidden_size"),
    ({"num_experts": 4, "top_k": 5}, "top_k 5 exceeds num_experts 4"),
    ([4, 2], "must be None or a dict of MoEConfig fields"),
])
def test_a_bad_moe_section_is_refused_naming_the_field(moe, said):
    with pytest.raises(ValueError) as info:
        LlamaConfig(moe=moe)
    assert said in str(info.value)


def test_a_meta_built_moe_llama_draws_what_a_seeded_one_does():
    with torch.device("meta"):
        meta = Llama(get_preset("tiny-moe"))
    meta.to_empty(device="cpu")
    meta.init_weights(seed=7)
    plain = Llama(get_preset("tiny-moe"))
    plain.init_weights(seed=7)
    for (name, a), b in zip(meta.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _initialize(rank: int, cfg: dict, moe: dict | None):
    config = get_preset("tiny").replace(num_hidden_layers=2, moe=moe)
    try:
        bunsan.initialize(Llama(config), cfg)
    except ValueError as e:
        return str(e)
    return None


EP2 = {"expert_parallel": {"enabled": True, "autoep_size": 2}, "train_micro_batch_size_per_gpu": 2}
TINY_MOE = {"num_experts": 4, "top_k": 2, "expert_intermediate_size": 32}


@pytest.mark.parametrize("cfg, moe, said", [
    (EP2, None, "has no bunsan MoE blocks"),
    ({**EP2, "expert_parallel": {"enabled": True, "autoep_size": 2}}, {**TINY_MOE, "num_experts": 3},
     "does not divide num_experts 3"),
], ids=["dense-model", "experts-not-divisible"])
def test_an_expert_parallel_layout_bunsan_cannot_run_is_refused_on_every_rank(pools, cfg, moe, said):
    said_by = pools.run(2, _initialize, cfg, moe)
    assert all(s is not None and said in s for s in said_by), said_by


def _initialize_world(rank: int, cfg: dict):
    try:
        bunsan.initialize(Llama(get_preset("tiny").replace(num_hidden_layers=2, moe=TINY_MOE)), cfg)
    except ValueError as e:
        return str(e)
    return None


def test_an_expert_parallel_size_that_does_not_divide_the_data_parallel_ranks_is_refused(pools):
    cfg = {"expert_parallel": {"enabled": True, "autoep_size": 4}, "train_micro_batch_size_per_gpu": 2}
    said = pools.run(2, _initialize_world, cfg)
    assert all("expert parallel size 4 does not divide the 2 data-parallel ranks" in s for s in said), said


# -- the command -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import argparse
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text(inspect.getsource(argparse))
    return d


def test_bunsan_train_trains_tiny_moe_with_experts_split_and_writes_a_mixtral(pools, tmp_path, corpus):
    ranks = pools.cli(2, ["train", "--nproc", "2", "--preset", "tiny-moe", "--ep", "2", "--zero", "2",
                          "--steps", "3", "--micro-batch", "2", "--seq-len", "32", "--data", corpus / "*.py",
                          "--output", tmp_path, "--set", f"data.cache_dir={tmp_path / 'cache'}",
                          "--set", "steps_per_print=1", "--set", "train.log_memory=true"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert last["moe/layers.0.mlp/load_max_over_mean"] >= 1.0
    assert last["moe/layers.0.mlp/dropped_fraction"] == 0.0
    for mem in last["memory"]:       # each rank holds half the experts: the ZeRO formulas of both groups
        assert mem["model_states"] == mem["theory_model_states"]
    full = get_preset("tiny-moe")
    assert last["memory"][0]["params"] < full.num_params() * 4
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    model = load_llama(tmp_path / "final")       # the whole experts, gathered from both ranks
    assert model.layers[0].mlp.experts.w1.shape[0] == 4


@pytest.mark.parametrize("rope", [{"rope_theta": 500000.0, "rope_type": "default"},
                                  {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}])
def test_a_transformers_5_llama_keeps_its_rope_parameters(tmp_path, rope):
    """transformers 5 writes rope_theta and the scaling inside rope_parameters: read there, not defaulted."""
    import transformers
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_parameters=rope)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    assert "rope_theta" not in json.loads((tmp_path / "config.json").read_text())
    model = load_llama(tmp_path)
    assert model.config.rope_theta == 500000.0
    ids = torch.randint(0, 256, (2, 100))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_rope_theta_said_twice_and_differently_is_refused():
    with pytest.raises(ValueError, match="disagree"):
        LlamaConfig.from_hf({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}})


def test_a_transformers_moe_counts_the_experts_a_token_passes_for_mfu():
    """bunsan train --init-from a transformers MoE: MFU's FLOPs per token count top_k of the routed experts."""
    import transformers
    from bunsan.training.hf_model import unrouted_parameters
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=1)
    model = transformers.MixtralForCausalLM(cfg)
    experts = 2 * 3 * 4 * 32 * 48          # layers x (gate, up, down) x experts x hidden x width
    assert unrouted_parameters(model) == experts * 3 // 4
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32,
                                                                   intermediate_size=48, num_hidden_layers=1,
                                                                   num_attention_heads=4))
    assert unrouted_parameters(dense) == 0


def _save_tp2(rank: int, path: str):
    engine = bunsan.initialize(Llama(get_preset("tiny").replace(num_hidden_layers=2, moe=TINY_MOE)),
                               {"tensor_parallel": {"size": 2}, "train_micro_batch_size_per_gpu": 2})
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    engine.train_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    engine.save_checkpoint(path)
    return engine.consolidated_state_dict()


def _load_dp2(rank: int, path: str):
    engine = bunsan.initialize(Llama(get_preset("tiny").replace(num_hidden_layers=2, moe=TINY_MOE)),
                               {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    engine.load_checkpoint(path)
    return engine.consolidated_state_dict()


def test_a_moe_checkpoint_saved_under_tensor_parallelism_loads_on_another_layout(pools, tmp_path):
    """Every expert's width cut over TP ranks in the shards; read back whole on a data-parallel layout."""
    saved = pools.run(2, _save_tp2, str(tmp_path / "ckpt"))[0]
    loaded = pools.run(2, _load_dp2, str(tmp_path / "ckpt"))[0]
    assert saved.keys() == loaded.keys()
    for key, want in saved.items():
        torch.testing.assert_close(loaded[key], want, rtol=0, atol=0, msg=key)


# -- a transformers Mixtral directory, trained and served as bunsan's MoE Llama -----------------------------
@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    import transformers
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mixtral")
    transformers.MixtralForCausalLM(cfg).save_pretrained(folder)
    return folder


def _load_into(rank: int, folder: str, cfg: dict):
    from bunsan.models.hf import read_config
    engine = bunsan.initialize(Llama(read_config(folder)), cfg)
    engine.load_hf_weights(folder)       # each rank reads its experts (EP) or their width (TP) only
    return engine.consolidated_state_dict()


@pytest.mark.parametrize("cfg", [{**EP2, "zero_optimization": {"stage": 3}},
                                 {"tensor_parallel": {"size": 2}, "train_micro_batch_size_per_gpu": 2}],
                         ids=["ep2-zero3", "tp2"])
def test_a_transformers_mixtral_loads_into_every_rank_of_a_split_moe_llama(pools, mixtral_dir, cfg):
    from bunsan.training.hf_model import is_other_architecture
    assert not is_other_architecture(mixtral_dir)       # bunsan train --init-from builds bunsan's Llama
    want = load_llama(mixtral_dir).state_dict()
    for state in pools.run(2, _load_into, str(mixtral_dir), cfg):
        for key, value in want.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


def test_a_moe_llama_served_with_prepacked_linears_gives_transformers_greedy_tokens(mixtral_dir):
    """The router is not a plain nn.Linear: serving's prepacking leaves it, and the batcher's tokens are
    transformers' own greedy ones."""
    import transformers
    from bunsan.serve.batcher import Batcher, Request
    from bunsan.serve.cpu_linear import pack_linears, packable
    from serve_harness import run_until_done
    model = load_llama(mixtral_dir).eval()
    if packable(model):
        pack_linears(model, rows=8)
    assert all(type(m.mlp.gate).__name__ == "Router" for m in model.layers)
    hf = transformers.AutoModelForCausalLM.from_pretrained(mixtral_dir).eval()
    prompts = [[5, 9, 11, 3], [5, 9, 11, 3, 200, 7, 1]]
    batcher = Batcher(model, slots=2, max_len=64, block_size=4, num_blocks=16)
    got, finished = [[] for _ in prompts], []
    for i, p in enumerate(prompts):
        batcher.submit(Request(p, 12, emit=lambda t, i=i: got[i].append(t.id), finish=finished.append))
    run_until_done(batcher, finished, len(prompts))
    for p, tokens in zip(prompts, got):
        want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
        assert tokens == want


def test_serve_tp2_splits_a_mixtrals_experts_by_width_and_gives_transformers_greedy_tokens(pools, mixtral_dir):
    import transformers
    from serve_harness import CEILING_S, tp_serving_job
    hf = transformers.AutoModelForCausalLM.from_pretrained(mixtral_dir).eval()
    torch.manual_seed(2)
    prompts = [torch.randint(3, 250, (n,)).tolist() for n in (4, 9)]
    argv = ["--checkpoint", mixtral_dir, "--slots", "2", "--context", "64", "--tp", "2", "--timeout", CEILING_S]
    got = pools.run(2, tp_serving_job, argv, prompts, 10, timeout=CEILING_S)[0]
    want = [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == want


def test_a_tensor_parallel_size_that_does_not_divide_the_experts_width_is_refused():
    from bunsan.models.moe import MoE as Block
    from bunsan.models.moe_config import MoEConfig
    from bunsan.tensor_parallel.moe import check_moe
    block = Block(MoEConfig(hidden_size=16, num_experts=4, top_k=2, expert_intermediate_size=30,
                            num_shared_experts=1, shared_intermediate_size=32))
    with pytest.raises(ValueError, match="does not divide layers.0.mlp's expert_intermediate_size \\(30\\)"):
        check_moe(block, "layers.0.mlp", 4)
    check_moe(block, "layers.0.mlp", 2)
