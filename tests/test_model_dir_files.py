"""Every JSON file bunsan reads from a model directory goes through one guarded reader (bunsan/models/model_dir.py):
a file that is not JSON, holds the wrong JSON type, lacks a field bunsan reads, or is a pipe or a directory in its
place is one line from the CLI naming the file, the rule and the fix; never a traceback, never a blocked read.

As a user meets them: a Hugging Face directory (`train --init-from`, `generate --checkpoint`, `estimate --model`),
`bunsan train`'s final/ (config.json as transformers writes it, bunsan.json beside it), its adapter/, a checkpoint
directory (`convert`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from bunsan.checkpoint.final import write_final
from bunsan.cli.main import main
from bunsan.models.hf import save_llama
from bunsan.models.model_dir import ModelFileError, field, read_json
from parity import tiny_model

pytest.importorskip("tokenizers")


# -- directories as bunsan meets them -----------------------------------------------------------------------------
def _tokenizer(folder) -> None:
    """A byte-level tokenizer of the tiny model's 256 tokens, with its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    t = Tokenizer(models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A Hugging Face Llama directory in shards (with its index) and a `bunsan train` output, made once."""
    root = tmp_path_factory.mktemp("dirs")
    model = tiny_model(0)
    hf = save_llama(model.state_dict(), model.config, root / "hf", max_shard_bytes=200_000)
    _tokenizer(hf)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    tokenizer = root / "tok"
    tokenizer.mkdir()
    _tokenizer(tokenizer)
    run = root / "run"
    run.mkdir()
    write_final(run / ".tmp", run / "final", model.state_dict(), model.config,
                {"bunsan_config": {}, "steps": 1}, tokenizer)
    return hf, run


@pytest.fixture
def hf(pristine, tmp_path):
    return shutil.copytree(pristine[0], tmp_path / "hf")


@pytest.fixture
def run(pristine, tmp_path):
    return shutil.copytree(pristine[1], tmp_path / "run")


def _break(path, how: str) -> None:
    """`path` replaced by what a damaged or hostile directory holds."""
    os.unlink(path) if os.path.lexists(path) else None
    if how == "not JSON":
        path.write_text("{bad")
    elif how == "a list":
        path.write_text("[1, 2]")
    elif how == "not UTF-8":
        path.write_bytes(b'{"x": "caf\xe9"}')
    elif how == "a FIFO":
        os.mkfifo(path)
    elif how == "a directory":
        path.mkdir()
    else:
        raise AssertionError(how)


RULES = {"not JSON": r"is not JSON \(Expecting property name enclosed in double quotes at line 1 column 2\)",
         "a list": r"holds a JSON list; a {name} is a JSON object",
         "not UTF-8": r"is not UTF-8 text \(byte 0xe9 at offset 10\)",
         "a FIFO": r"is a named pipe \(FIFO\), not a regular file",
         "a directory": r"is a directory, not a regular file"}


def _one_line(capsys, cmd: str, path) -> str:
    """The CLI's message: one line, `bunsan CMD: ...`, naming `path`, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"bunsan {cmd}: {path}"), lines[0]
    return lines[0]


# -- a Hugging Face directory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", list(RULES))
@pytest.mark.parametrize("cmd", ["train", "generate", "estimate"])
def test_config_json_of_a_hugging_face_directory(hf, capsys, cmd, how):
    import re
    _break(hf / "config.json", how)
    argv = {"train": ["train", "--init-from", str(hf)], "generate": ["generate", "--checkpoint", str(hf)],
            "estimate": ["estimate", "--model", str(hf)]}[cmd]
    assert main(argv) == 2
    line = _one_line(capsys, cmd, hf / "config.json")
    assert re.search(RULES[how].format(name="config.json"), line), line
    if how in ("not JSON", "a list", "a FIFO"):
        assert "restore it from the model's source" in line


@pytest.mark.parametrize("cmd", ["train", "generate"])
def test_a_llama_config_json_without_its_shape(hf, capsys, cmd):
    config = json.loads((hf / "config.json").read_text())
    del config["hidden_size"]
    (hf / "config.json").write_text(json.dumps(config))
    argv = ["train", "--init-from", str(hf)] if cmd == "train" else ["generate", "--checkpoint", str(hf)]
    assert main(argv) == 2
    assert 'has no "hidden_size" (a JSON integer: part of the Llama\'s shape' in _one_line(capsys, cmd,
                                                                                          hf / "config.json")


def test_a_config_json_field_of_the_wrong_type_names_the_file(hf, capsys):
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    assert main(["generate", "--checkpoint", str(hf)]) == 2
    assert '"num_hidden_layers" is a JSON string, where config.json holds a JSON integer' in \
        _one_line(capsys, "generate", hf / "config.json")


def test_init_from_a_directory_without_config_json(tmp_path, capsys):
    assert main(["train", "--init-from", str(tmp_path)]) == 2
    assert "has no config.json: point at a Hugging Face model directory" in _one_line(capsys, "train", tmp_path)


@pytest.mark.parametrize("how", ["not JSON", "a list", "a FIFO"])
def test_the_shards_index(hf, capsys, how):
    import re
    _break(hf / "model.safetensors.index.json", how)
    assert main(["generate", "--checkpoint", str(hf)]) == 2
    line = _one_line(capsys, "generate", hf / "model.safetensors.index.json")
    assert re.search(RULES[how].format(name="model.safetensors.index.json"), line), line


def test_an_index_without_its_weight_map(hf, capsys):
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert main(["generate", "--checkpoint", str(hf)]) == 2
    assert 'has no "weight_map" (a JSON object: the file of each weight)' in \
        _one_line(capsys, "generate", hf / "model.safetensors.index.json")


@pytest.mark.parametrize("name,how", [("tokenizer_config.json", "not JSON"), ("tokenizer_config.json", "a list"),
                                      ("tokenizer_config.json", "a FIFO"), ("tokenizer.json", "a FIFO"),
                                      ("tokenizer.json", "a directory")])
def test_the_tokenizers_files(hf, capsys, name, how):
    import re
    _break(hf / name, how)
    assert main(["generate", "--checkpoint", str(hf), "--max-new-tokens", "1"]) == 2
    line = _one_line(capsys, "generate", hf / name)
    assert re.search(RULES[how].format(name=name), line), line


@pytest.mark.parametrize("how", ["not JSON", "a FIFO"])
def test_a_damaged_generation_config_is_said_and_ignored(hf, capsys, caplog, how):
    """generation_config.json is optional: generation stops at the tokenizer's end token, with a warning that
    names the file."""
    _break(hf / "generation_config.json", how)
    assert main(["generate", "--checkpoint", str(hf), "--max-new-tokens", "2"]) == 0
    assert f"{hf / 'generation_config.json'} is " in caplog.text
    assert "generation stops at the tokenizer's end token only" in caplog.text


def test_convert_of_a_hugging_face_directory_says_what_it_is(hf, tmp_path, capsys):
    assert main(["convert", str(hf), str(tmp_path / "out.safetensors")]) == 2
    line = _one_line(capsys, "convert", hf)
    assert "has no bunsan.json: it is a Hugging Face model directory, not the final/ folder of `bunsan train` " \
           "(which holds bunsan.json, bunsan's record of the run, beside the model's config.json" in line
    assert "no \"model\" object" not in line


# -- bunsan train's output: final/ ---------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["not JSON", "a list", "a FIFO", "a directory"])
@pytest.mark.parametrize("cmd", ["generate", "convert"])
def test_bunsan_json(run, tmp_path, capsys, cmd, how):
    import re
    _break(run / "final" / "bunsan.json", how)
    argv = ["generate", "--checkpoint", str(run)] if cmd == "generate" else \
        ["convert", str(run), str(tmp_path / "out.safetensors")]
    assert main(argv) == 2
    line = _one_line(capsys, cmd, run / "final" / "bunsan.json")
    assert re.search(RULES[how].format(name="bunsan.json"), line), line
    if how != "a directory":
        assert "copy final/ again whole from where `bunsan train` wrote it" in line


def test_bunsan_json_without_its_weights_record(run, capsys):
    meta = json.loads((run / "final" / "bunsan.json").read_text())
    del meta["weights"]
    (run / "final" / "bunsan.json").write_text(json.dumps(meta))
    assert main(["generate", "--checkpoint", str(run)]) == 2
    assert 'has no "weights" (a JSON object: each weights file\'s sha256 and size)' in \
        _one_line(capsys, "generate", run / "final" / "bunsan.json")


def test_a_bunsan_config_that_is_not_an_object_is_never_read_as_a_path(run, capsys):
    meta = json.loads((run / "final" / "bunsan.json").read_text())
    (run / "final" / "bunsan.json").write_text(json.dumps({**meta, "bunsan_config": "/etc/passwd"}))
    assert main(["generate", "--checkpoint", str(run)]) == 2
    assert '"bunsan_config" is a JSON string, where bunsan.json holds a JSON object' in \
        _one_line(capsys, "generate", run / "final" / "bunsan.json")


@pytest.mark.parametrize("how", ["not JSON", "a list", "a FIFO"])
def test_config_json_of_final(run, capsys, how):
    import re
    _break(run / "final" / "config.json", how)
    assert main(["generate", "--checkpoint", str(run)]) == 2
    line = _one_line(capsys, "generate", run / "final" / "config.json")
    assert re.search(RULES[how].format(name="config.json"), line), line


def test_a_link_in_final_is_refused(run, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text((run / "final" / "bunsan.json").read_text())
    (run / "final" / "bunsan.json").unlink()
    (run / "final" / "bunsan.json").symlink_to(elsewhere)
    assert main(["generate", "--checkpoint", str(run)]) == 2
    assert "is a symbolic link: bunsan reads" in _one_line(capsys, "generate", run / "final" / "bunsan.json")


def test_a_tokenizer_recorded_elsewhere_names_bunsan_json(run, tmp_path, capsys):
    (run / "final" / "tokenizer.json").unlink()
    meta = json.loads((run / "final" / "bunsan.json").read_text())
    tok = tmp_path / "tok"
    tok.mkdir()
    _tokenizer(tok)
    (run / "final" / "bunsan.json").write_text(json.dumps({**meta, "bunsan_config": {
        "data": {"tokenizer": str(tok / "tokenizer.json")}}}))
    assert main(["generate", "--checkpoint", str(run)]) == 2
    line = _one_line(capsys, "generate", run / "final" / "bunsan.json")
    assert "records the tokenizer" in line and "--tokenizer PATH/tokenizer.json" in line
    assert "config.json names the tokenizer" not in line


# -- adapter/ and a checkpoint directory ------------------------------------------------------------------------
@pytest.mark.parametrize("content,message", [
    ("{bad", r"is not JSON \(Expecting property name"), ("[1, 2]", r"holds a JSON list; an adapter_config.json is a"),
    ('{"peft_type": "LORA"}', r'has no "r" \(a JSON integer: the adapter\'s rank\)'),
    ('{"peft_type": "IA3", "r": 8}', r"peft_type is 'IA3'; bunsan merges and serves LoRA adapters only")])
def test_adapter_config_json(tmp_path, capsys, content, message):
    import re
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    (adapter / "adapter_config.json").write_text(content)
    assert main(["generate", "--checkpoint", str(adapter)]) == 2
    assert re.search(message, _one_line(capsys, "generate", adapter / "adapter_config.json"))


def test_a_rank_file_that_is_a_fifo_is_not_called_missing(tmp_path, capsys):
    import bunsan
    from parity import batches
    engine = bunsan.initialize(tiny_model(0), {"train_micro_batch_size_per_gpu": 2,
                                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.train_batch(batches(1, 2)[0])
    engine.save_checkpoint(tmp_path / "ckpt")
    rank = tmp_path / "ckpt" / "global_step1" / "rank00000.safetensors"
    _break(rank, "a FIFO")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{rank} is a named pipe (FIFO), not the regular file its save wrote" in err
    assert "is missing" not in err and "Traceback" not in err


# -- the reader itself -----------------------------------------------------------------------------------------
def test_fields_and_sizes(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"r": True, "alpha": 2}))
    data = read_json(path)
    with pytest.raises(ModelFileError, match=r'"r" is a JSON boolean, where config.json holds a JSON integer'):
        field(data, "r", path, int, "the rank")
    assert field(data, "alpha", path, (int, float), "the scale") == 2
    assert field(data, "missing", path, int, "anything", default=7) == 7
    with pytest.raises(ModelFileError, match=r"holds a JSON object; a config.json is a JSON list"):
        read_json(path, expect=list)
    big = tmp_path / "generation_config.json"
    big.write_text(" " * (2 << 20) + "{}")
    with pytest.raises(ModelFileError, match=r"is 2,097,154 bytes; the model's generation settings .* is at most "
                                             r"1,048,576"):
        read_json(big)


def test_processor_configs(tmp_path):
    pytest.importorskip("transformers")
    from bunsan.models.processor import processor_class
    (tmp_path / "preprocessor_config.json").write_text('"Qwen2VLProcessor"')
    with pytest.raises(ModelFileError, match=r"preprocessor_config.json holds a JSON string; a "
                                             r"preprocessor_config.json is a JSON object"):
        processor_class(tmp_path)
