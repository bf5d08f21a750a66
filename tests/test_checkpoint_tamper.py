"""A checkpoint handed over by a stranger: every name in it is checked before it is opened, nothing outside
the directory is read, written or echoed, and what cannot be loaded exactly is refused (an older whole
checkpoint is used instead, with a message)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import bunsan
from bunsan.checkpoint.store import CheckpointError
from parity import batches, tiny_model

SECRET = "outside-the-checkpoint-7f3a"
CFG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _engine(seed=0):
    return bunsan.initialize(tiny_model(seed), CFG)


@pytest.fixture
def saved(tmp_path):
    """D with global_step1 and global_step2 (latest), and a file outside D."""
    d = tmp_path / "D"
    engine = _engine()
    for s, b in enumerate(batches(2, 2)):
        engine.train_batch(b)
        engine.save_checkpoint(d, client_state={"step": s + 1})
    outside = tmp_path / "outside.txt"
    outside.write_text(SECRET)
    return d, outside, engine.consolidated_state_dict()


def _rewrite(d, tag, fn):
    """Change meta.json as an attacker would, checksum included."""
    path = d / tag / "meta.json"
    meta = json.loads(path.read_text())
    meta = fn(meta) or meta
    text = json.dumps(meta).encode()
    path.write_bytes(text)
    (d / tag / "meta.sha256").write_text(hashlib.sha256(text).hexdigest())


def _load(d, tag=None):
    engine = _engine(seed=5)
    path, client = engine.load_checkpoint(d, tag)
    return path.name, client


def test_save_never_writes_through_a_symlink(saved):
    d, outside, _ = saved
    os.symlink(outside, d / "latest.tmp")
    os.symlink(outside, d / ".tmp-global_step9")
    engine = _engine()
    engine.save_checkpoint(d, tag="global_step9")
    assert outside.read_text() == SECRET
    assert (d / "latest").read_text() == "global_step9" and not (d / "latest").is_symlink()


@pytest.mark.parametrize("evil", ["/etc/passwd", "../outside.txt", "../../x", ".hidden", "a/b"])
def test_a_piece_naming_another_file_is_refused(saved, capfd, evil):
    d, outside, _ = saved

    def swap(meta):
        meta["pieces"][0]["file"] = evil
        meta["files"][evil] = meta["files"].pop(next(iter(meta["files"])))
    _rewrite(d, "global_step2", swap)
    assert _load(d) == ("global_step1", {"step": 1})      # the older whole checkpoint instead
    err = capfd.readouterr().err
    assert "global_step2" in err and "not a plain name" in err and SECRET not in err


def test_a_piece_whose_file_is_not_listed_is_refused(saved, capfd):
    d, _, _ = saved
    _rewrite(d, "global_step2", lambda m: m["pieces"][0].update(file="rank00001.safetensors"))
    assert _load(d)[0] == "global_step1"
    assert "does not list" in capfd.readouterr().err


@pytest.mark.parametrize("content", ["../..", "/tmp", "global_step1/../..", ""])
def test_latest_that_is_not_a_tag_is_ignored(saved, capfd, content):
    d, _, _ = saved
    (d / "latest").write_text(content)
    assert _load(d)[0] == "global_step2"                # the newest complete one inside D
    assert "is not a small regular file holding a tag name" in capfd.readouterr().err


def test_latest_as_a_symlink_is_never_read_or_echoed(saved, capfd):
    d, outside, _ = saved
    (d / "latest").unlink()
    os.symlink(outside, d / "latest")
    assert _load(d)[0] == "global_step2"
    assert SECRET not in capfd.readouterr().err


def test_a_tag_directory_that_is_a_symlink_is_not_a_checkpoint(saved, tmp_path, capfd):
    d, _, _ = saved
    elsewhere = tmp_path / "elsewhere"
    os.replace(d / "global_step1", elsewhere)
    os.symlink(elsewhere, d / "global_step99")
    assert _load(d, "global_step99")[0] == "global_step2"     # refused, with the reason
    assert "symbolic link" in capfd.readouterr().err
    (d / "global_step2" / "meta.json").write_text("[]")
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        _load(d)


def test_altered_meta_json_is_refused_by_its_checksum(saved, capfd):
    d, _, _ = saved
    path = d / "global_step2" / "meta.json"
    path.write_text(path.read_text().replace('"step": 2', '"step": 3'))
    assert _load(d)[0] == "global_step1"
    assert "meta.sha256" in capfd.readouterr().err


def _shrink(meta):
    meta["pieces"][0]["hi"] -= 5      # its last 5 elements in no piece


def test_a_missing_piece_is_refused_not_zeros(saved, capfd):
    d, _, _ = saved
    _rewrite(d, "global_step2", _shrink)
    assert _load(d)[0] == "global_step1"
    assert "would load as zeros" in capfd.readouterr().err
    _rewrite(d, "global_step1", lambda m: m["pieces"].pop(0) and None)      # a whole tensor gone
    with pytest.raises(CheckpointError, match="has no weights for"):
        _load(d)


def test_overlapping_pieces_are_refused(saved, capfd):
    d, _, _ = saved

    def overlap(meta):
        p = dict(meta["pieces"][0])
        p["hi"] = max(p["lo"] + 1, p["hi"] // 2)
        meta["pieces"].append(p)
    _rewrite(d, "global_step2", overlap)
    assert _load(d)[0] == "global_step1"
    assert "in two pieces" in capfd.readouterr().err


@pytest.mark.parametrize("sections", [0, 2.5, "3", 7])
def test_a_piece_with_sections_that_do_not_divide_its_rows_is_refused(saved, capfd, sections):
    """`sections` (a fused projection's blocks of rows, pieces.py) must be a count > 1 dividing the rows of the
    dim a tensor is split along: a whole tensor given sections, or a count that is not one, is damage."""
    d, _, _ = saved
    _rewrite(d, "global_step2", lambda m: m["pieces"][0].update(sections=sections))
    assert _load(d)[0] == "global_step1"
    assert "has sections" in capfd.readouterr().err


@pytest.mark.parametrize("first", [-1, 1.5, 10 ** 9])
def test_a_piece_with_a_run_of_experts_it_cannot_hold_is_refused(saved, capfd, first):
    """`expert_start` (expert x tensor parallelism: the run of experts along dim 0, pieces.py) on a piece that is
    not cut along another dim, or past its tensor's experts, is damage."""
    d, _, _ = saved
    _rewrite(d, "global_step2", lambda m: m["pieces"][0].update(expert_start=first))
    assert _load(d)[0] == "global_step1"
    assert "has expert_start" in capfd.readouterr().err


def test_a_piece_named_like_a_path_is_refused(saved, capfd):
    d, _, _ = saved
    _rewrite(d, "global_step2", lambda m: m["pieces"][0].update(name="../../etc/passwd"))
    assert _load(d)[0] == "global_step1"
    assert "not a parameter name" in capfd.readouterr().err


@pytest.mark.parametrize("damage", ["[]", "null", '{"format": 1}', "{", '{"step": "x"}'])
def test_a_damaged_older_checkpoint_never_blocks_a_newer_one(saved, damage):
    d, _, state = saved
    (d / "global_step1" / "meta.json").write_text(damage)
    assert _load(d) == ("global_step2", {"step": 2})
    engine = _engine(seed=5)
    engine.load_checkpoint(d)
    for k, v in engine.consolidated_state_dict().items():
        assert torch.equal(v, state[k]), k


def test_convert_refuses_a_tampered_checkpoint_and_says_which_tag_it_used(saved, tmp_path, capfd):
    from bunsan.checkpoint.convert import convert
    d, _, _ = saved
    _rewrite(d, "global_step2", _shrink)
    out = convert(d, tmp_path / "out.safetensors")
    assert out.is_file()
    err = capfd.readouterr().err
    assert "global_step1" in err and "global_step2" in err and "would load as zeros" in err


def test_nan_weights_in_a_checkpoint_are_named_on_load(tmp_path):
    engine = _engine()
    with torch.no_grad():
        engine.module.norm.weight.fill_(float("nan"))     # (fp32 at ZeRO-0: the weight is its own master)
    engine.save_checkpoint(tmp_path / "D")
    with pytest.raises(CheckpointError, match="NaN or infinite weights"):
        _load(tmp_path / "D")


def _lora_tied_pp(rank, world, root):
    lora = {"enabled": True, "r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    cfg = {"train_batch_size": 2, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2}, "lora": lora,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with torch.device("meta"):
        model = tiny_model(0, tie_word_embeddings=True)
    engine = bunsan.initialize(model, cfg)
    engine.train_batch(batches(1, 2)[0])
    engine.save_checkpoint(root)
    with torch.device("meta"):
        other = tiny_model(0, tie_word_embeddings=True)
    again = bunsan.initialize(other, cfg)
    return again.load_checkpoint(root)[0].name


def test_frozen_weights_tied_across_stages_are_written_once(pools, tmp_path):
    """LoRA freezes a tied embedding and head that live on different stages: one writer, so the index
    covers it exactly once and the checkpoint loads."""
    assert pools.run(2, _lora_tied_pp, 2, str(tmp_path / "D")) == ["global_step1"] * 2


@pytest.mark.parametrize("tag", ["-1.5", "epoch:3", "my run"])
def test_deepspeed_style_tags_save_and_load(tmp_path, tag):
    engine = _engine()
    engine.save_checkpoint(tmp_path / "D", tag=tag)
    assert _load(tmp_path / "D", tag)[0] == tag
