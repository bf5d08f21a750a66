"""Loads that are exact or refused: a Hugging Face directory or a training output whose weights do not match
its config.json, or that names files outside itself, is an error naming what is wrong."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from bunsan.cli.generate import trained_model
from bunsan.models.hf import load_llama, save_llama
from parity import tiny_model


@pytest.fixture
def hf_dir(tmp_path):
    model = tiny_model(0)
    return save_llama(model.state_dict(), model.config, tmp_path / "hf", max_shard_bytes=200_000)


def test_config_json_with_fewer_layers_than_the_weights_is_refused(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.2"):
        load_llama(hf_dir)


def test_a_missing_tensor_is_refused(hf_dir):
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="missing.*down_proj"):
        load_llama(hf_dir)


@pytest.mark.parametrize("evil", ["../../etc/passwd", "/etc/passwd", ".."])
def test_a_weight_map_outside_the_directory_is_refused(hf_dir, evil):
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = evil
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="not a plain file"):
        load_llama(hf_dir)


def _final(tmp_path, tokenizer=None):
    model = tiny_model(0)
    final = tmp_path / "final"
    final.mkdir()
    save_file(model.state_dict(), str(final / "model.safetensors"))
    (final / "config.json").write_text(json.dumps({"model": model.config.to_hf(),
                                                   "bunsan_config": {"data": {"tokenizer": tokenizer}}}))
    return final


def test_generate_loads_a_training_output_exactly(tmp_path):
    final = _final(tmp_path)
    model, _ = trained_model(tmp_path)
    assert model.norm.weight.shape[0] == 128
    state = load_file(str(final / "model.safetensors"))
    del state["layers.1.mlp.down_proj.weight"]
    save_file(state, str(final / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.down_proj.weight'\]"):
        trained_model(tmp_path)


def test_a_tokenizer_path_outside_the_output_is_not_followed(tmp_path):
    _final(tmp_path, tokenizer="/somewhere/else/tokenizer.json")
    with pytest.raises(ValueError, match="pass it yourself: bunsan generate --tokenizer"):
        trained_model(tmp_path)
