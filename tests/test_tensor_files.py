"""Weights handed over by anyone, in every loader (resume, convert, generate/serve, --init-from): a safetensors
header that lies (a dtype changed with its bytes kept, a 10 GiB header length, offsets past the end), metadata
that does not describe its weights, a tied config beside a stored head, and final/ weights altered after
training are each refused with a message naming the file and the rule, never loaded as something else.
`bunsan convert` takes a `bunsan train` output folder; a full disk leaves nothing half-written."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load_file

import bunsan
from bunsan.checkpoint.convert import convert
from bunsan.checkpoint.store import CheckpointError
from bunsan.cli.generate import trained_model
from bunsan.cli.main import main
from bunsan.config.root import Config
from bunsan.models.hf import check_llama_dir, load_llama, read_config, save_llama
from bunsan.training.loop import save_weights
from parity import batches, tiny_model

CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture
def run(tmp_path):
    """A training output RUN (final/ with its digest) and a checkpoint directory CKPT of the same engine."""
    engine = bunsan.initialize(tiny_model(0), CFG)
    engine.train_batch(batches(1, 2)[0])
    engine.save_checkpoint(tmp_path / "CKPT")
    out = tmp_path / "RUN"
    save_weights(engine, Config.load(CFG), engine.module.config, out, {"steps": 1})
    return out, tmp_path / "CKPT", engine.consolidated_state_dict()


# -- a safetensors header, rewritten as an attacker would --------------------------------------------------
def _header(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data, length=None):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _retype(path, dtype="I32"):
    """The first F32 tensor's dtype changed, its bytes kept (same size: the header stays consistent)."""
    header, data = _header(path)
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = dtype
    _write(path, header, data)
    return name


def _past_the_end(path):
    header, data = _header(path)
    name = next(k for k in header if k != "__metadata__")
    a, b = header[name]["data_offsets"]
    header[name]["data_offsets"] = [a + len(data), b + len(data)]
    _write(path, header, data)


def _huge_length(path):
    header, data = _header(path)
    _write(path, header, data, length=10 << 30)


def _reseal_checkpoint(ckpt):
    """meta.json's file hashes and its own checksum updated: the alteration passes every digest."""
    tag = (ckpt / "latest").read_text().strip()
    meta_path = ckpt / tag / "meta.json"
    meta = json.loads(meta_path.read_text())
    for name, info in meta["files"].items():
        f = ckpt / tag / name
        info.update(sha256=hashlib.sha256(f.read_bytes()).hexdigest(), bytes=f.stat().st_size)
    text = json.dumps(meta).encode()
    meta_path.write_bytes(text)
    (ckpt / tag / "meta.sha256").write_text(hashlib.sha256(text).hexdigest())


def _reseal_final(final):
    meta = json.loads((final / "bunsan.json").read_text())
    w = final / "model.safetensors"
    meta["weights"] = {w.name: {"sha256": hashlib.sha256(w.read_bytes()).hexdigest(), "bytes": w.stat().st_size}}
    (final / "bunsan.json").write_text(json.dumps(meta))


DAMAGE = {"retyped": (_retype, "stored as int32, but was saved as float32"),
          "huge_header": (_huge_length, "the header length says 10,737,418,240 bytes"),
          "past_the_end": (_past_the_end, "outside the")}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_lying_header_is_refused_by_resume_and_convert(run, tmp_path, damage):
    _, ckpt, _ = run
    alter, message = DAMAGE[damage]
    tag = (ckpt / "latest").read_text().strip()
    alter(ckpt / tag / "rank00000.safetensors")
    _reseal_checkpoint(ckpt)
    engine = bunsan.initialize(tiny_model(1), CFG)
    with pytest.raises(CheckpointError, match=message.split(",")[0] if damage != "retyped" else message):
        engine.load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=message.split(",")[0] if damage != "retyped" else message):
        convert(ckpt, tmp_path / "out.safetensors")


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_lying_header_in_final_weights_is_refused_by_generate(run, damage):
    out, _, _ = run
    alter, message = DAMAGE[damage]
    alter(out / "final" / "model.safetensors")
    _reseal_final(out / "final")
    expected = "is stored as int32; weights are floating point" if damage == "retyped" else message.split(",")[0]
    with pytest.raises(CheckpointError, match=expected):
        trained_model(out)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_lying_header_in_a_hf_directory_is_refused_by_every_loader(run, tmp_path, damage):
    _, _, state = run
    hf = save_llama(state, tiny_model(0).config, tmp_path / "hf")
    alter, message = DAMAGE[damage]
    alter(hf / "model.safetensors")
    expected = "is stored as int32; weights are floating point" if damage == "retyped" else message.split(",")[0]
    with pytest.raises(ValueError, match=expected):
        load_llama(hf)                                    # generate, serve
    with pytest.raises(ValueError, match=expected):
        check_llama_dir(hf, read_config(hf))              # train --init-from checks the directory first


def test_final_weights_altered_after_training_fail_their_digest(run):
    out, _, _ = run
    w = out / "final" / "model.safetensors"
    header, data = _header(w)
    name = next(k for k in header if k != "__metadata__")
    a = header[name]["data_offsets"][0]
    data = data[:a] + struct.pack("<f", 3.4e38) + data[a + 4:]      # one float, the header untouched
    _write(w, header, data)
    with pytest.raises(CheckpointError, match="does not match the digest"):
        trained_model(out)


def test_convert_takes_a_train_output_folder(run, tmp_path, capsys):
    out, _, state = run
    assert main(["convert", str(out), str(tmp_path / "hf"), "--to", "hf"]) == 0
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    got = model.state_dict()
    for k, v in state.items():
        key = k if k.startswith("lm_head.") else f"model.{k}"
        assert torch.equal(got[key], v), k
    assert main(["convert", str(out), str(tmp_path / "one.safetensors")]) == 0
    assert set(load_file(str(tmp_path / "one.safetensors"))) == set(state)
    assert main(["convert", str(out), str(tmp_path / "x"), "--tag", "global_step1"]) == 2
    assert "final/ weights have no tags" in capsys.readouterr().err


def test_convert_refuses_a_model_config_that_does_not_describe_the_weights(run, tmp_path):
    _, ckpt, _ = run

    def fewer_layers():
        tag = (ckpt / "latest").read_text().strip()
        meta_path = ckpt / tag / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["model"].update(num_hidden_layers=2, vocab_size=512)
        text = json.dumps(meta).encode()
        meta_path.write_bytes(text)
        (ckpt / tag / "meta.sha256").write_text(hashlib.sha256(text).hexdigest())
    fewer_layers()
    with pytest.raises(CheckpointError, match=r"do not match the model config it records \(2 layers, vocabulary "
                                              r"512\): .*unexpected \['layers.2"):
        convert(ckpt, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()


def test_a_tied_config_beside_a_stored_head_is_refused(run, tmp_path):
    _, _, state = run
    hf = save_llama(state, tiny_model(0).config, tmp_path / "hf")       # untied: lm_head.weight stored
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings true, but the weights hold an lm_head.weight"):
        check_llama_dir(hf, read_config(hf))


def test_generate_takes_a_hugging_face_directory(run, tmp_path):
    _, _, state = run
    hf = save_llama(state, tiny_model(0).config, tmp_path / "hf")
    with pytest.raises(SystemExit, match="Hugging Face directory without tokenizer.json; pass --tokenizer"):
        trained_model(hf)


@pytest.mark.parametrize("to", ["safetensors", "hf"])
def test_convert_into_a_full_disk_leaves_nothing(run, tmp_path, monkeypatch, to):
    out, _, _ = run
    import bunsan.checkpoint.convert as conv
    import bunsan.models.hf as hf

    def full(tensors, path, metadata=None):      # some bytes reach the disk, then it is full
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(conv, "save_file", full)
    monkeypatch.setattr(hf, "save_file", full)
    target = tmp_path / "conv" / ("one.safetensors" if to == "safetensors" else "hf")
    with pytest.raises(CheckpointError, match="No space left on device.*nothing partial was left"):
        convert(out, target, to)
    assert [p.name for p in (tmp_path / "conv").iterdir()] == []


def test_an_integer_buffer_saves_and_resumes(tmp_path):
    """Buffers are saved as they are (an int64 counter, a bool mask): their dtype is recorded and checked, not
    required to be floating point."""
    def model():
        m = tiny_model(0)
        m.register_buffer("seen", torch.tensor([7, 8], dtype=torch.int64))
        m.register_buffer("keep", torch.tensor([True, False]))
        return m
    engine = bunsan.initialize(model(), CFG)
    engine.train_batch(batches(1, 2)[0])
    engine.save_checkpoint(tmp_path / "D")
    fresh = model()
    fresh.seen.zero_()
    other = bunsan.initialize(fresh, CFG)
    other.load_checkpoint(tmp_path / "D")
    assert other.module.seen.tolist() == [7, 8] and other.module.keep.tolist() == [True, False]


def test_generate_takes_a_sharded_hugging_face_directory(run, tmp_path):
    _, _, state = run
    hf = save_llama(state, tiny_model(0).config, tmp_path / "hf", max_shard_bytes=200_000)
    assert (hf / "model.safetensors.index.json").is_file() and not (hf / "model.safetensors").exists()
    model, _ = trained_model(hf, tokenizer_path="byte")
    for k, v in model.state_dict().items():
        if k in state:
            assert torch.equal(v, state[k]), k
