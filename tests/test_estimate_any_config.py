"""`bunsan estimate` / `plan` on configs that are not a Llama's (a LLaVA with its vision tower, a Qwen2): priced
from the model transformers builds on the meta device, every parameter counted (a LLaVA-1.5-7B config was
priced as a 3.3M-parameter Llama before), ZeRO-3's units found as the engine finds them, and what is not
priced (activations) said in the table and the verdict."""

from __future__ import annotations

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
    from bunsan.estimator.shape import load_shape, rank_params
    shape = load_shape(str(llava))
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(llava.parent))
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert 7.0e9 < shape.n_params < 7.1e9                       # LLaVA-1.5-7B
    rp = rank_params(shape)[0]
    # the units the engine gathers (zero/units.py): the 32 text blocks, the vision tower's 24 and its patch
    # embedding (its _no_split_modules); the root is the token embedding, the head and the projector
    from bunsan.zero.units import find_units
    assert len(find_units(model, [])) == 57 and rp.blocks == 57 and rp.root < 0.05 * rp.total


def test_estimate_and_plan_say_what_they_do_not_price(llava):
    from bunsan.cli.main import main
    assert main(["estimate", "--model", str(llava), "--gpus", "2", "--zero", "3", "--bf16", "--seq-len", "1024",
                 "--micro-batch", "1", "--gpu", "h100"]) == 0
    assert main(["plan", "--model", str(llava), "--gpus", "8", "--gpu", "a100", "--seq-len", "2048", "--top",
                 "2"]) == 0


def test_the_estimate_names_unpriced_activations(llava):
    from bunsan.estimator import estimate
    est = estimate(str(llava), {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "train_micro_batch_size_per_gpu": 1}, gpus=2)
    item = next(i for i in est.items if i.name == "activations")
    assert item.note.startswith("NOT PRICED") and item.device == 0
    gathered = next(i for i in est.items if i.name == "ZeRO-3 gathered")
    assert gathered.device < 2 * GiB                  # a unit and its prefetch, not the whole 13 GiB model
