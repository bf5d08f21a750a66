"""Bad input that used to load wrong, hang or end in a traceback: each is refused at once with one message
naming the file (or the key), what is wrong with it and the fix. Data paths that are not text files (a sparse
or binary file, a FIFO, a device, a loop of links, latin-1 text), records that are not UTF-8 or not JSON, a
tokenizer that is not one, data.cache_dir naming a file, a config that is not UTF-8, a checkpoint whose step
counters are strings or whose optimizer is another one, LoRA with no target, a config.json that lies about its
shape."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

import bunsan
from bunsan.checkpoint.store import CheckpointError
from bunsan.config.errors import ConfigError
from bunsan.models.llama import LlamaConfig
from bunsan.training.data import TokenCache, load_tokenizer, resolve_paths
from bunsan.training.examples import read_records
from parity import batches, tiny_model


# -- data paths ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="bytes read are counted by Linux's /proc/self/io")
def test_a_huge_sparse_file_is_refused_at_once(tmp_path):
    def bytes_read() -> int:          # by this process, every read call counted
        with open("/proc/self/io") as f:
            return int(next(line.split()[1] for line in f if line.startswith("rchar:")))

    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(20 << 30)              # 20 GiB of holes: NUL bytes when read
    before = bytes_read()
    with pytest.raises(ValueError, match=r"sparse.txt is not text: a NUL byte at offset 0 \(a binary or sparse"):
        resolve_paths([str(sparse)])
    assert bytes_read() - before < 16 << 20       # its start, not its 20 GiB (nor a digest of them)


def test_paths_that_are_not_files_say_what_they_are(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases = {str(fifo): r"is a named pipe \(FIFO\), not a file", "/dev/zero": "is a character device, not a file",
             str(tmp_path / "a"): "is a loop of symbolic links", str(tmp_path / "dangling"): "a symbolic link to "
             "nothing", str(tmp_path / "missing"): "does not exist"}
    for path, message in cases.items():
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            resolve_paths([path])


def test_latin1_text_is_refused_naming_the_file_and_offset(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes(b"ok line\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"latin.txt is not UTF-8: byte 0xe9 near offset 11 .*iconv"):
        resolve_paths([str(f)])
    big = tmp_path / "late.txt"     # past the start the paths check reads: the tokenising pass finds it
    big.write_bytes(b"x" * (1 << 17) + b"\xff")
    cache = TokenCache(resolve_paths([str(big)]), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"late.txt is not UTF-8: byte 0xff near offset 131,072"):
        cache.build()


def test_records_that_are_not_utf8_or_not_json_name_the_file(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"a.jsonl:2: not UTF-8 \(byte 0xe9"):
        list(read_records([jsonl]))
    broken = tmp_path / "b.json"
    broken.write_text('[{"text": "x"},')
    with pytest.raises(ValueError, match=r"b.json: not JSON \(Expecting value at line 1 column 16\)"):
        list(read_records([broken]))
    parquet = tmp_path / "c.parquet"
    parquet.write_text("not parquet")
    with pytest.raises(ValueError, match=r"c.parquet: not a readable Parquet file"):
        list(read_records([parquet]))


def test_a_tokenizer_that_is_not_json_and_a_cache_dir_that_is_a_file(tmp_path):
    tok = tmp_path / "tok.json"
    tok.write_text("not json")
    with pytest.raises(ValueError, match=r"tok.json is not a Hugging Face tokenizer.json"):
        load_tokenizer(tok)
    text = tmp_path / "t.txt"
    text.write_text("hello\n")
    with pytest.raises(ValueError, match=r"data.cache_dir '.*afile' is a file, not a directory"):
        (tmp_path / "afile").write_text("")
        TokenCache([text], cache_dir=tmp_path / "afile")


def test_a_config_file_that_is_not_utf8(tmp_path):
    f = tmp_path / "c.json"
    f.write_bytes(b'{"train_micro_batch_size_per_gpu": 2, "x": "caf\xe9"}')
    with pytest.raises(ConfigError, match=r"c.json' is not UTF-8 \(byte 0xe9 at offset 47"):
        bunsan.Config.load(str(f))


# -- checkpoints ----------------------------------------------------------------------------------------------
CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _saved(tmp_path, cfg=CFG):
    engine = bunsan.initialize(tiny_model(0), cfg)
    engine.train_batch(batches(1, 2)[0])
    engine.save_checkpoint(tmp_path / "D")
    return tmp_path / "D"


def _edit_meta(d, fn):
    tag = (d / "latest").read_text().strip()
    path = d / tag / "meta.json"
    meta = json.loads(path.read_text())
    fn(meta)
    text = json.dumps(meta).encode()
    path.write_bytes(text)
    (d / tag / "meta.sha256").write_text(hashlib.sha256(text).hexdigest())


@pytest.mark.parametrize("field,value,message", [
    ("global_step", "3", r"engine.global_step is '3', not a non-negative integer"),
    ("scale", "65536", r"engine.scaler.scale is '65536', not a positive finite number")])
def test_step_counters_and_loss_scale_of_the_wrong_kind_are_refused(tmp_path, field, value, message):
    cfg = {**CFG, "fp16": {"enabled": True}}
    d = _saved(tmp_path, cfg)
    _edit_meta(d, lambda m: (m["engine"]["scaler"] if field == "scale" else m["engine"]).update({field: value}))
    engine = bunsan.initialize(tiny_model(1), cfg)
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(d)


def test_resuming_with_another_optimizer_says_so(tmp_path):
    d = _saved(tmp_path)
    sgd = {**CFG, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    engine = bunsan.initialize(tiny_model(1), sgd)
    with pytest.raises(CheckpointError, match=r"holds the states of a AdamW optimizer, and this engine steps SGD: "
                                              r"load the weights alone \(load_optimizer_states=False"):
        engine.load_checkpoint(d)
    engine.load_checkpoint(d, load_optimizer_states=False)       # the weights alone: allowed
    assert engine.global_step == 1


# -- configs ---------------------------------------------------------------------------------------------------
def test_lora_without_targets_is_a_config_error():
    with pytest.raises(ConfigError, match=r"lora.target_modules.*is empty, so no layer would get an adapter"):
        bunsan.Config.load({"lora": {"enabled": True, "target_modules": []}})


def test_a_config_json_whose_hidden_size_lies_is_named(tmp_path):
    """hidden_size 256 beside head_dim 32 x 4 heads is a valid config.json (heads set apart from hidden / heads,
    as Mistral Nemo's), so the lie shows at the weights: the tensor whose shape disagrees is named."""
    import json
    from bunsan.models.hf import load_llama, save_llama
    model = tiny_model(0)
    hf = model.config.to_hf()
    out = save_llama(model.state_dict(), model.config, tmp_path / "hf")
    (out / "config.json").write_text(json.dumps({**hf, "hidden_size": 256}))
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \[256, 128\], its config.json says "
                                         r"\[256, 256\]"):
        load_llama(out)
    with pytest.raises(ValueError, match=r"hidden_size 130 is not divisible by num_attention_heads 4"):
        LlamaConfig.from_hf({**hf, "hidden_size": 130, "head_dim": None})
