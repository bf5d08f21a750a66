"""`bunsan estimate` / `plan` on configs that are not a Llama's (a LLaVA with its vision tower, a Qwen2): priced
from the model transformers builds on the meta device, every parameter counted (a LLaVA-1.5-7B config was
priced as a 3.3M-parameter Llama before), ZeRO-3's units found as the engine finds them, and what is not
priced (activations) said in the table and the verdict."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

GiB = 1024 ** 3


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    text = transformers.LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008,
                                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)
    vision = transformers.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                           num_attention_heads=16, image_size=336, patch_size=14)
    path = tmp_path_factory.mktemp("llava") / "config.json"
    path.write_text(transformers.LlavaConfig(text_config=text, vision_config=vision).to_json_string())
    return path


def test_a_composite_config_is_priced_from_its_own_modules(llava):
    import torch
    from bunsan.estimator.rank_params import rank_params
    from bunsan.estimator.shape import load_shape
    shape = load_shape(str(llava))
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(llava.parent))
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert 7.0e9 < shape.n_params < 7.1e9                       # LLaVA-1.5-7B
    rp = rank_params(shape)[0]
    # the units the engine gathers (zero/units.py): the 32 text blocks, the vision tower's 24 and its patch
    # embedding (its _no_split_modules); the root is the token embedding, the head and the projector
    from bunsan.zero.units import find_units
    assert len(find_units(model, [])) == 57 == len(rp.units) and rp.root < 0.05 * rp.total
    assert rp.blocks == 32                 # the blocks whose activations are priced: the language model's


def _said(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())      # (rich wraps the table's cells)


def test_estimate_and_plan_say_what_they_do_not_price(llava, capsys, monkeypatch):
    from bunsan.cli.main import main
    monkeypatch.setenv("COLUMNS", "1000")      # the table's rows on one line each
    capsys.readouterr()
    assert main(["estimate", "--model", str(llava), "--gpus", "2", "--zero", "3", "--bf16", "--seq-len", "1024",
                 "--micro-batch", "1", "--gpu", "h100"]) == 0
    out = _said(capsys)
    assert "(NOT PRICED: the activations of model.vision_tower, model.multi_modal_projector)" in out
    assert "NOT PRICED: the activations of model.vision_tower (1 CLIPVisionEmbeddings, 24 CLIPEncoderLayer); " \
           "model.multi_modal_projector: they depend on the images or clips per sample" in out
    assert "transformers blocks priced as a Llama block" in out and "before activations (not priced" in out
    assert main(["plan", "--model", str(llava), "--gpus", "8", "--gpu", "a100", "--seq-len", "2048", "--top",
                 "2"]) == 0
    out = _said(capsys)
    assert "(NOT PRICED: the activations of model.vision_tower, model.multi_modal_projector)" in out
    assert "the peaks price its language model's blocks' activations (each as a Llama block of its shape), not its " \
           "encoders' (NOT PRICED: the peaks are floors)" in out
    assert "its step time is not modelled (its encoders' compute depends on the images or clips per sample)" in out
    # searched over tensor and pipeline parallelism as the engine splits it (the CLIP tower too), but not over
    # sequence parallelism, which the engine refuses for a composite model: said
    assert "- sp: sequence parallelism: the engine refuses it for a composite model" in out
    assert main(["plan", "--model", str(llava), "--gpus", "8", "--gpu", "a100", "--seq-len", "2048", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert {c["layout"]["tp"] for c in ranked} >= {2, 4, 8} and {c["layout"]["pp"] for c in ranked} > {1}
    assert not any(c["layout"]["sequence_parallel"] for c in ranked)


def test_the_estimate_prices_the_language_model_and_names_the_encoders(llava):
    """LLaVA-1.5-7B: its 32 Llama blocks priced as bunsan's Llama of that shape (they run the saving forms),
    the vision tower's activations named as not priced."""
    from bunsan.estimator import estimate
    from bunsan.estimator.activations import Micro, block_bytes
    from bunsan.models.llama import LlamaConfig
    est = estimate(str(llava), {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "train_micro_batch_size_per_gpu": 1, "data": {"seq_len": 1024}}, gpus=2)
    item = next(i for i in est.items if i.name == "activations")
    lm = LlamaConfig(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, max_position_embeddings=4096)
    assert item.device > 32 * block_bytes(lm, Micro(1, 1024, 2)) > 3 * GiB
    encoders = next(i for i in est.items if i.name == "encoder activations")
    assert encoders.note.startswith("NOT PRICED") and encoders.device == 0
    gathered = next(i for i in est.items if i.name == "ZeRO-3 gathered")
    assert gathered.device < 2 * GiB                  # a unit and its prefetch, not the whole 13 GiB model


def test_a_transformers_llama_module_is_priced():
    import torch
    from bunsan.estimator.shape import load_shape
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
    shape = load_shape(model)
    assert shape.blocks_as is not None and shape.blocks_as.num_hidden_layers == 2 and not shape.caveats


@pytest.mark.parametrize("kind", ["llava", "qwen2_vl", "qwen2_audio"])
@pytest.mark.parametrize("zero", [0, 3])
def test_a_frozen_encoder_is_held_as_weights(kind, zero):
    """A frozen tower's weights are held (in the model dtype; sharded at ZeRO-3, as the engine shards them),
    with no gradients, master weights or optimizer states: the estimate's parameters are every element the
    model has, its other states those of the trained ones."""
    from bunsan.estimator import estimate
    from test_multimodal import build, encoder
    model = build(kind)
    every = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for p in encoder(model).requires_grad_(False).parameters())
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": zero}, "optimizer": {"type": "SGD"}}
    est = estimate(model, cfg, gpus=2 if zero else 1, device_type="cpu")
    params = next(i for i in est.items if i.name == "params")
    assert params.note.startswith(f"{every:,} elements") and f"{frozen:,} frozen" in params.note
    assert f"{every - frozen:,} trained" in params.note
    assert est.model_states["params"] >= 4 * every / (2 if zero else 1)
    assert est.model_states["grads"] < 4 * (every - frozen) * 1.05
    if zero == 0:        # as the engine holds them, after a step (ZeRO-3 on two ranks: test_multimodal.py)
        import bunsan
        from test_multimodal import _cfg, batches
        engine = bunsan.initialize(model, {**_cfg(), **cfg, "train_batch_size": 4})
        engine.train_batch(batches(kind, 1)[0])
        assert engine.memory_report()["model_states"] == est.model_states["model_states"]


# Published configs, written out (no hub access in the tests): the sizes their model cards give
QWEN2_AUDIO_7B = {"architectures": ["Qwen2AudioForConditionalGeneration"], "model_type": "qwen2_audio",
                  "audio_token_index": 151646, "vocab_size": 156032,
                  "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 1280, "encoder_layers": 32,
                                   "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_mel_bins": 128,
                                   "max_source_positions": 1500},
                  "text_config": {"model_type": "qwen2", "vocab_size": 156032, "hidden_size": 4096,
                                  "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 32, "max_position_embeddings": 8192}}
LLAVA_15_7B = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
               "text_config": {"model_type": "llama", "vocab_size": 32064, "hidden_size": 4096,
                               "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                               "num_key_value_heads": 32, "max_position_embeddings": 4096},
               "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                                 "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                                 "patch_size": 14, "projection_dim": 768}}
QWEN2_VL_7B = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
               "text_config": {"model_type": "qwen2_vl_text", "vocab_size": 152064, "hidden_size": 3584,
                               "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                               "num_key_value_heads": 4, "max_position_embeddings": 32768,
                               "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
               "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16,
                                 "mlp_ratio": 4, "patch_size": 14, "spatial_merge_size": 2, "in_chans": 3,
                                 "temporal_patch_size": 2}}
WHISPER_LARGE_V3 = {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
                    "vocab_size": 51866, "d_model": 1280, "encoder_layers": 32, "decoder_layers": 32,
                    "encoder_attention_heads": 20, "decoder_attention_heads": 20, "encoder_ffn_dim": 5120,
                    "decoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500,
                    "max_target_positions": 448}


def _tiny(kind: str) -> dict:
    if kind == "whisper":
        return transformers.WhisperConfig(vocab_size=320, d_model=32, encoder_layers=2, decoder_layers=2,
                                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                          decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
                                          max_target_positions=32, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2, decoder_start_token_id=1).to_dict()
    from test_multimodal import build
    return build(kind).config.to_dict()


def _write(tmp_path, d: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


FULL = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_audio": "Qwen2AudioForConditionalGeneration", "whisper": "WhisperForConditionalGeneration"}


@pytest.mark.parametrize("kind", list(FULL))
@pytest.mark.parametrize("architectures", [True, False], ids=["named", "unnamed"])
def test_the_whole_model_is_priced_with_its_head(tmp_path, kind, architectures):
    """The class config.architectures names, else the most complete one transformers maps model_type to: the
    audio-language model (not Qwen2AudioModel without its LM head), Whisper's encoder with its decoder (not the
    decoder alone as WhisperForCausalLM): every parameter the real model has, counted on the meta device."""
    import torch
    from bunsan.estimator.shape import load_shape
    d = {k: v for k, v in _tiny(kind).items() if k != "architectures"}
    if architectures:
        d["architectures"] = [FULL[kind]]
    shape = load_shape(_write(tmp_path, d))
    with torch.device("meta"):
        real = getattr(transformers, FULL[kind])(transformers.AutoConfig.for_model(**d))
    assert shape.name.partition(" ")[0] == FULL[kind] and not any("head" in c for c in shape.caveats)
    assert shape.n_params == sum(p.numel() for p in real.parameters())


@pytest.mark.parametrize("d,cls,billions", [(QWEN2_AUDIO_7B, "Qwen2AudioForConditionalGeneration", 8.40),
                                            (LLAVA_15_7B, "LlavaForConditionalGeneration", 7.06),
                                            (QWEN2_VL_7B, "Qwen2VLForConditionalGeneration", 8.29),
                                            (WHISPER_LARGE_V3, "WhisperForConditionalGeneration", 1.54)],
                         ids=["qwen2-audio-7b", "llava-1.5-7b", "qwen2-vl-7b", "whisper-large-v3"])
def test_published_configs_are_priced_at_their_published_size(tmp_path, d, cls, billions):
    import torch
    from bunsan.estimator.shape import load_shape
    shape = load_shape(_write(tmp_path, d))
    with torch.device("meta"):
        real = getattr(transformers, cls)(transformers.AutoConfig.for_model(**d))
    assert shape.n_params == sum(p.numel() for p in real.parameters())
    assert shape.n_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_a_price_without_the_head_or_with_an_unknown_class_says_so(tmp_path, capsys):
    """A config naming the base model (no LM head) or a class this transformers lacks is priced as what is
    built, and the estimate's title says what that leaves out."""
    from bunsan.cli.main import main
    from bunsan.estimator.shape import load_shape
    base = load_shape(_write(tmp_path, {**_tiny("qwen2_audio"), "architectures": ["Qwen2AudioModel"]}))
    assert base.name.startswith("Qwen2AudioModel (no LM head") and "not counted" in base.name
    odd = _write(tmp_path, {**_tiny("qwen2_audio"), "architectures": ["Qwen2AudioForMyTask"]})
    assert load_shape(odd).name.startswith("Qwen2AudioForConditionalGeneration (config.architectures names "
                                           "Qwen2AudioForMyTask, which this transformers does not have")
    capsys.readouterr()
    assert main(["estimate", "--model", odd, "--gpus", "1", "--seq-len", "64", "--micro-batch", "1"]) == 0
    assert "Qwen2AudioForMyTask" in " ".join(capsys.readouterr().out.split())


def test_estimate_prices_a_padding_mask_when_told(tmp_path, capsys):
    """`bunsan estimate --padding-mask` on a transformers config prices batches with a padding attention_mask
    (K/V repeated, each layer's mask kept: tests/test_activation_bound.py), more than without; without it the
    note says what padding would add."""
    from bunsan.cli.main import main
    path = _write(tmp_path, {**transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2).to_dict(), "architectures": ["Qwen2ForCausalLM"]})

    def activations(*flags) -> dict:
        capsys.readouterr()
        assert main(["estimate", "--model", path, "--gpus", "1", "--seq-len", "2048", "--micro-batch", "2",
                     "--json", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layout"]["padding_mask"] == bool(flags)
        return next(i for i in out["items"] if i["name"] == "activations")
    plain, padded = activations(), activations("--padding-mask")
    assert padded["device"] > plain["device"]
    assert "one with padding would add" in plain["note"] and "batches with a padding attention_mask" in padded["note"]
