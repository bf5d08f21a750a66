"""`bunsan plan` and `bunsan estimate` on transformers configs, as a user runs them (a config.json written out):
a Llama-form model (Qwen2) searched over tensor and pipeline parallelism, split as the engine splits it, and its
step priced as the Llama of its shape (Mistral's within its sliding window); what is
not searched for a model said by name with why (GPT-2 ships no tensor-parallel plan); the closing line saying what
the peaks price; the ZeRO-by-stage table holding frozen weights as weights only, as the estimate does."""

from __future__ import annotations

import json

import pytest

from bunsan.cli.main import main

transformers = pytest.importorskip("transformers")

# Qwen2-7B's published config.json (28 heads over 4 key/value heads; q/k/v with biases; untied head)
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "use_sliding_window": False,
            "sliding_window": 131072, "max_window_layers": 28, "bos_token_id": 151643, "eos_token_id": 151643}
# GPT-2 XL's: Conv1D layers and no base_model_tp_plan, blocks under transformer.h
GPT2_XL = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
           "n_embd": 1600, "n_layer": 48, "n_head": 25, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05}


def _write(tmp_path, d: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


def _said(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())         # (rich wraps long lines)


def _json(capsys, argv) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(argv + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def qwen2_rank_elements(c: dict, tp: int) -> int:
    """Qwen2's parameters on one tensor-parallel rank, from its config alone (Megatron's split): q, k, v and
    their biases, gate and up by output rows, o and down by input columns, the embedding and head by vocabulary
    rows padded to a multiple of tp; the norms whole."""
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = h // c["num_attention_heads"]
    q, kv = h // tp, c["num_key_value_heads"] * head_dim // tp       # output rows of q and of k (and v)
    block = (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * (i // tp) + 2 * h
    vocab = -(-c["vocab_size"] // tp) * h
    return layers * block + 2 * vocab + h


def test_plan_ranks_tensor_and_pipeline_layouts_of_a_qwen2_config(tmp_path, capsys):
    model = _write(tmp_path, QWEN2_7B)
    argv = ["plan", "--model", model, "--gpus", "8", "--gpu", "a100-40gb", "--seq-len", "4096", "--global-batch",
            "16", "--top", "0"]
    rc, data = _json(capsys, argv)
    assert rc == 0
    meshes = {(c["layout"]["tp"], c["layout"]["pp"]) for c in data["ranked"]}
    assert {(2, 1), (4, 1), (1, 2), (2, 2), (4, 2), (2, 4)} <= meshes     # tp 8 cannot split 28 heads
    assert data["rejected"]["tp_heads"]["example"].startswith("tp 8 against 28 heads")
    # what the engine does not run for a transformers model, by name: no context parallelism, no sequence
    # parallelism under pipeline stages (and none searched there)
    assert sorted(data["not_searched"]) == ["cp", "sp"]
    assert not any(c["layout"]["sequence_parallel"] and c["layout"]["pp"] > 1 for c in data["ranked"])
    assert any(c["layout"]["sequence_parallel"] for c in data["ranked"])
    written = tmp_path / "layout.json"
    assert main(argv[:-1] + ["3", "--output", str(written)]) == 0
    out = _said(capsys)
    # the first choice's layout, without a model section: `bunsan train` would build a Llama in its place
    best = json.loads(written.read_text())
    assert "model" not in best and best["tensor_parallel"]["size"] == data["ranked"][0]["layout"]["tp"]
    assert f"wrote {written}, the layout only: `bunsan train` builds bunsan's Llama, not this Qwen2ForCausalLM" in out
    assert "not searched for this model (the ranking is of the rest):" in out
    for dim, why in data["not_searched"].items():
        assert f"- {dim}: {why}" in out
    assert all(c["describe"] in out for c in data["ranked"][:3])
    # ranked by step time, priced as the Llama of its shape (test_a_qwen2_config_is_priced_as_the_llama_of_its_shape)
    assert all(c["step_seconds"] is not None for c in data["ranked"])
    sure = [c["step_seconds"]["total"] for c in data["ranked"] if not c["risk"]]
    assert sure == sorted(sure) and len(sure) > 100
    assert "Qwen2ForCausalLM priced as bunsan's Llama of its shape" in out and "step time is not modelled" not in out


def _llama_of(config: dict) -> dict:
    """A bunsan Llama config.json of a Llama-form model's dimensions."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "head_dim")
    return {"model_type": "llama", **{k: config[k] for k in keep if k in config}}


# Gemma 2B's dimensions: one key/value head, head_dim 256 = hidden / heads, the head tied to the embedding
GEMMA_2B = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "vocab_size": 256000, "hidden_size": 2048,
            "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
            "head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "rope_theta": 10000.0}


# Qwen3-0.6B's published config.json: 16 heads of 128 (2,048 wide) on a 1,024-wide residual stream, tied
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
             "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
             "max_window_layers": 28, "hidden_act": "silu", "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config", [QWEN2_7B, GEMMA_2B, QWEN3_06B], ids=["qwen2", "gemma-tied", "qwen3-head-dim"])
def test_a_qwen2_config_is_priced_as_the_llama_of_its_shape(tmp_path, capsys, config):
    """Qwen2's blocks run a Llama block's GEMMs and attention (its q/k/v biases aside), and whole steps measure
    within 4% of bunsan's Llama's on a CPU (benchmarks/bench_hf_blocks.py), so its step is priced as the Llama of
    its shape: each layout both plans rank prices the same terms, and the Qwen2 plan says what it assumed. Gemma's
    head tied to its embedding is carried (the data-parallel bytes count the table once); Qwen3 0.6B's heads, set
    apart from hidden / heads, are priced at their own width (head_dim carried into the Llama config.json)."""
    argv = ["--gpus", "8", "--gpu", "h100", "--seq-len", "4096", "--global-batch", "16", "--top", "0",
            "--zero-stages", "1,3", "--recompute", "none,full"]
    _, qwen = _json(capsys, ["plan", "--model", _write(tmp_path, config)] + argv)
    _, llama = _json(capsys, ["plan", "--model", _write(tmp_path, _llama_of(config), "llama.json")] + argv)
    terms = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble", "offload", "optimizer", "cp_comm")

    def key(c: dict) -> tuple:
        return c["describe"], c["layout"]["pipeline_gather"]          # (ZeRO-3 under stages: both searched)
    llama_steps = {key(c): c["step_seconds"] for c in llama["ranked"]}
    both = [(c["step_seconds"], llama_steps[key(c)]) for c in qwen["ranked"] if key(c) in llama_steps]
    assert len(both) > 50
    for q, ll in both:
        assert {t: q[t] for t in terms} == {t: ll[t] for t in terms}
        assert q["assumptions"][:-1] == ll["assumptions"]
        assert q["assumptions"][-1].startswith(f"{config['architectures'][0]} priced as bunsan's Llama of its shape")


MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
                  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096,
                  "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_mistral_is_timed_within_its_sliding_window_and_ranked_by_memory_past_it(tmp_path, capsys):
    """Mistral 7B v0.1 attends over a 4,096-token sliding window: rows within it cost the causal square the
    cost model prices, longer rows less, so past it the plan ranks by memory and its closing line says why."""
    model = _write(tmp_path, MISTRAL_7B_V01)
    argv = ["plan", "--model", model, "--gpus", "8", "--gpu", "h100", "--global-batch", "8", "--zero-stages", "3",
            "--recompute", "full", "--top", "1"]
    assert main(argv + ["--seq-len", "4096"]) == 0
    out = _said(capsys)
    assert "MistralForCausalLM priced as bunsan's Llama of its shape" in out and "not modelled" not in out
    assert main(argv + ["--seq-len", "8192"]) == 0
    out = _said(capsys)
    window = ("its attention's sliding window of 4096 tokens is shorter than the 8192-token rows, where it computes "
              "less than the causal square the cost model prices")
    assert f"MistralForCausalLM: its step time is not modelled ({window}), so layouts are ranked by memory" in out
    _, data = _json(capsys, argv[:-2] + ["--top", "0", "--seq-len", "8192"])
    assert data["ranked"] and not any(c["layout"]["offload_blocks"] for c in data["ranked"])
    # and --explain of a layout at rows past the window, from a plan within it, says why it cannot price it
    assert main(argv + ["--seq-len", "4096", "--explain", "zero=3,recompute=full,seq=8192"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "this model's step time is not modelled at 8192 tokens (its attention's sliding window" in err
    # nor retried with blocks' activations offloaded: their traffic is priced in the step time only
    assert f"offload_blocks: blocks' activations offloaded to host memory (activation_checkpointing.offload_blocks): " \
           f"a layout too big is retried with them where the step time prices their traffic, not for this model " \
           f"({window})" in out


def test_a_qwen2_layout_too_big_is_retried_with_blocks_activations_offloaded(tmp_path, capsys):
    """With its step priced, a Qwen2 layout whose activations do not fit is retried with its first blocks' saved
    activations in host memory (the engine's offload_blocks, transforms/offload.py), their traffic in the step
    time, as for bunsan's Llama."""
    _, data = _json(capsys, ["plan", "--model", _write(tmp_path, QWEN2_7B), "--gpus", "8", "--gpu", "a100-40gb",
                             "--seq-len", "8192", "--global-batch", "16", "--top", "0"])
    offloaded = [c for c in data["ranked"] if c["layout"]["offload_blocks"]]
    assert offloaded and all(c["step_seconds"]["offload"] > 0 for c in offloaded)
    assert "act->cpu(" in offloaded[0]["describe"] and "offload_blocks" not in data["not_searched"]


@pytest.mark.parametrize("tp,pp", [(2, 1), (4, 1), (2, 2)])
def test_the_estimate_at_tp_holds_what_the_split_of_the_config_gives(tmp_path, capsys, tp, pp):
    """Qwen2-7B at tp 2 and 4: the parameters one rank holds equal the count from the config alone; under two
    pipeline stages each rank holds the embedding or the head with its 14 blocks."""
    model = _write(tmp_path, QWEN2_7B)
    rc, data = _json(capsys, ["estimate", "--model", model, "--tp", str(tp), "--pp", str(pp), "--bf16",
                              "--seq-len", "2048", "--micro-batch", "1", "--grad-accum", str(2 * pp)])
    assert rc == 0
    params = next(i for i in data["items"] if i["name"] == "params")
    whole = qwen2_rank_elements(QWEN2_7B, tp)
    if pp == 1:
        assert params["note"] == f"{whole:,} elements" and params["device"] == 2 * whole
    else:        # 14 blocks each, and the embedding (rank 0) or the final norm and the head (rank 1)
        vocab, h = -(-QWEN2_7B["vocab_size"] // tp) * QWEN2_7B["hidden_size"], QWEN2_7B["hidden_size"]
        stage = (whole - 2 * vocab - h) // 2 + vocab + (h if data["rank_shown"] == 1 else 0)
        assert params["note"] == f"{stage:,} elements"
    activations = next(i for i in data["items"] if i["name"] == "activations")
    assert activations["device"] > 0 and "priced as a Llama block of their shape" in activations["note"]


def _engine_rank(rank, model_dir, tp):
    import bunsan
    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config)
    engine = bunsan.initialize(model, {"train_batch_size": 2, "tensor_parallel": {"size": tp},
                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    ids = __import__("torch").randint(0, config.vocab_size, (2, 8))
    engine.train_batch({"input_ids": ids, "labels": ids})
    return sum(p.numel() for p in engine.module.parameters()), engine.memory_report()["model_states"]


def _composite_rank(rank, kind, cfg):
    import bunsan
    from test_multimodal import batches, build
    engine = bunsan.initialize(build(kind), cfg)
    engine.train_batch(batches(kind, 1)[0])
    return sum(p.numel() for p in engine.module.parameters()), engine.memory_report()["model_states"]


def test_the_estimate_at_tp2_equals_the_engine_on_the_same_config(pools, tmp_path):
    """A small Qwen2 built by transformers from the config.json, trained by the engine at tp 2 on two gloo
    ranks: each rank's parameters and model states are the estimate's (vocabulary 1001: padded to 1002)."""
    from bunsan.estimator import estimate
    small = {**QWEN2_7B, "vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 0}
    _write(tmp_path, small)
    results = pools.run(2, _engine_rank, str(tmp_path), 2)
    est = estimate(str(tmp_path / "config.json"), {"train_batch_size": 2, "tensor_parallel": {"size": 2},
                                                    "optimizer": {"type": "SGD"}}, device_type="cpu")
    assert [n for n, _ in results] == [qwen2_rank_elements(small, 2)] * 2 == [est.trained[0].total] * 2
    assert [s for _, s in results] == [est.model_states["model_states"]] * 2


def test_a_gpt2_config_says_tensor_and_pipeline_parallelism_are_not_searched_and_why(tmp_path, capsys):
    model = _write(tmp_path, GPT2_XL)
    rc, data = _json(capsys, ["plan", "--model", model, "--gpus", "8", "--gpu", "a100", "--zero-stages", "1",
                              "--recompute", "full"])
    assert rc == 0 and {c["layout"]["tp"] for c in data["ranked"]} == {1} == {c["layout"]["pp"] for c in data["ranked"]}
    assert data["not_searched"]["tp"].startswith("tensor parallelism (tp 1 only): GPT2LMHeadModel ships no "
                                                 "tensor-parallel plan (config.base_model_tp_plan is empty)")
    assert "pipeline parallelism cuts a model into an ordered list of layers; GPT2LMHeadModel is neither" in \
        data["not_searched"]["pp"]
    assert data["rejected"]["unsearched"]["count"] == 3 + 3      # tp 2, 4, 8; pp 2, 4, 8 at tp 1
    assert data["seq_len"] == 1024                                 # its n_positions, not 2048
    assert main(["plan", "--model", model, "--gpus", "8", "--gpu", "a100", "--zero-stages", "1", "--recompute",
                 "full", "--top", "1"]) == 0
    out = _said(capsys)
    assert "- tp: tensor parallelism (tp 1 only): GPT2LMHeadModel ships no tensor-parallel plan" in out
    assert out.endswith("the peaks leave its activations out (NOT PRICED: they are floors; measure a step, "
                        "engine.memory_report())")
    # and an estimate asked for it says the same, by name
    assert main(["estimate", "--model", model, "--tp", "2"]) != 0
    assert "ships no tensor-parallel plan" in capsys.readouterr().err


def test_a_model_the_engine_cannot_split_is_refused_by_name(tmp_path, capsys):
    """Gemma's scaled embedding is not a plain nn.Embedding: the engine's vocabulary split refuses it, so the
    estimate refuses tp 2 with the engine's words, and the plan searches tp 1 only and says why."""
    gemma = _write(tmp_path, {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "vocab_size": 2048,
                              "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64})
    assert main(["estimate", "--model", gemma, "--tp", "2"]) != 0
    assert "the engine does not split GemmaForCausalLM over 2 ranks: vocab_embedding splits a plain nn.Embedding; " \
           "GemmaTextScaledWordEmbedding" in " ".join(capsys.readouterr().err.split())
    rc, data = _json(capsys, ["plan", "--model", gemma, "--gpus", "2", "--zero-stages", "0", "--recompute", "none"])
    assert rc == 0 and {c["layout"]["tp"] for c in data["ranked"]} == {1}
    assert "GemmaTextScaledWordEmbedding" in data["not_searched"]["tp"] and "pp" not in data["not_searched"]


def test_the_zero_table_holds_frozen_weights_as_weights(tmp_path, capsys):
    """LoRA on Qwen2 (the base frozen): the ZeRO-by-stage table's row at the layout's stage is the estimate's
    model states, and every row holds the frozen base as weights only (no gradients or optimizer states)."""
    model = _write(tmp_path, {**QWEN2_7B, "num_hidden_layers": 4})
    for stage in (1, 3):
        config = _write(tmp_path, {"lora": {"enabled": True, "r": 8}, "zero_optimization": {"stage": stage},
                                   "bf16": {"enabled": True}}, "train.json")
        rc, data = _json(capsys, ["estimate", "--model", model, "--config", config, "--gpus", "4", "--seq-len",
                                  "1024", "--micro-batch", "1"])
        assert rc == 0
        z, held = data["zero_stages"], data["items"]
        states = sum(i["device"] + i["host"] + i["disk"] for i in held
                     if i["name"] in ("params", "grads", "master_weights", "optimizer_states"))
        assert z["stages"][stage]["this_layout_bytes"] == pytest.approx(states)
        phi, psi = z["frozen_params_per_model_parallel_rank"], z["psi_params_per_model_parallel_rank"]
        assert phi > 100 * psi > 0                    # the base, frozen, against the adapters
        # (no stage's model states near 16 bytes per base element, as they were when the base counted as trained)
        assert all(row["this_layout_bytes"] < 2.2 * phi for row in z["stages"])
        assert z["stages"][0]["zero_paper_bytes"] == pytest.approx(2 * phi + 16 * psi)
    assert main(["estimate", "--model", model, "--config", config, "--gpus", "4", "--seq-len", "1024"]) == 0
    assert f"Φ = {phi / 1e9:.3g}B frozen: weights only, no grads or optimizer states)" in _said(capsys)


def test_a_frozen_encoder_is_weights_only_in_the_zero_table():
    """A LLaVA whose vision tower is frozen (in the module handed to the estimator): the table agrees with the
    estimate's model states at the layout's stage."""
    from bunsan.cli.plan_json import zero_stages
    from bunsan.estimator import estimate
    from test_multimodal import built
    for stage in (0, 2, 3):
        est = estimate(built("llava", frozen=True), {"train_batch_size": 2, "zero_optimization": {"stage": stage}},
                       gpus=2, device_type="cpu")
        z = zero_stages(est)
        assert z["frozen_params_per_model_parallel_rank"] == est.shape.n_frozen
        assert z["stages"][stage]["this_layout_bytes"] == est.model_states["model_states"]


def test_a_composite_model_at_tp2_holds_what_the_engine_holds(pools):
    """A LLaVA at tp 2: its language model split by its plan, its CLIP tower by bunsan's (hf_plan.ENCODER_PLANS),
    its projector whole; each rank's parameters and model states are the estimate's."""
    from bunsan.estimator import estimate
    from test_multimodal import build
    cfg = {"train_batch_size": 4, "tensor_parallel": {"size": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    results = pools.run(2, _composite_rank, "llava", cfg)
    est = estimate(build("llava"), cfg, device_type="cpu")
    whole = sum(p.numel() for p in build("llava").parameters())
    assert whole / 2 < est.trained[0].total < 0.6 * whole
    assert [r for r in results] == [(est.trained[0].total, est.model_states["model_states"])] * 2


@pytest.mark.parametrize("use_sliding,max_window_layers,timed",
                         [(False, 28, True), (True, 28, True), (True, 20, False)])
def test_qwen2s_sliding_window_counts_only_where_its_layers_slide(tmp_path, use_sliding, max_window_layers, timed):
    """Qwen2 slides its attention only with use_sliding_window, and then only in the layers from max_window_layers
    on (transformers' layer_types): rows past its window are timed unless some layer slides."""
    from bunsan.estimator.shape import load_shape
    config = {**QWEN2_7B, "use_sliding_window": use_sliding, "sliding_window": 4096,
              "max_window_layers": max_window_layers}
    shape = load_shape(_write(tmp_path, config))
    assert shape.timed_as(4096) is not None
    assert (shape.timed_as(8192) is not None) is timed


# Qwen3-8B's published config.json: q/k norms on every head, head_dim 128 = hidden / heads
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
            "hidden_act": "silu", "torch_dtype": "bfloat16"}


def test_qwen3_is_priced_as_the_llama_of_its_shape_with_its_qk_norms_inputs(tmp_path, capsys):
    """Qwen3's blocks are a Llama block's with an RMSNorm on each q and k head, which in the saving forms keeps
    its input and an fp32 rstd per token and head (measured: tests/test_activation_bound.py): its activations are
    the Llama of its shape's plus b·s·(a + kv)·(2e + 4) bytes a block in bf16, and its step is timed."""
    from bunsan.estimator import estimate
    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "data": {"seq_len": 4096},
           "zero_optimization": {"stage": 3}}

    def activations(config: dict, name: str) -> float:
        e = estimate(_write(tmp_path, config, name), cfg, gpus=8)
        return next(i for i in e.items if i.name == "activations").device
    extra = activations(QWEN3_8B, "qwen3.json") - activations(_llama_of(QWEN3_8B), "llama.json")
    assert extra == 36 * 1 * 4096 * (32 + 8) * (2 * 128 + 4)
    _, data = _json(capsys, ["plan", "--model", _write(tmp_path, QWEN3_8B), "--gpus", "8", "--gpu", "h100",
                             "--seq-len", "4096", "--global-batch", "16", "--zero-stages", "3", "--top", "3"])
    assert all(c["step_seconds"] is not None for c in data["ranked"])
    assert data["ranked"][0]["step_seconds"]["assumptions"][-1].startswith(
        "Qwen3ForCausalLM priced as bunsan's Llama of its shape: the same GEMMs and attention, its element-wise ops "
        "as the Llama block's; its q/k norms' passes not priced (their saved inputs are)")
