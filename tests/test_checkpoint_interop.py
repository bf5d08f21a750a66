"""Checkpoints in training and out of it: a killed rank resumed by torchrun, `bunsan convert`, and Hugging Face
Llama directories in (any layout, each rank its slices) and out, checked against `transformers`."""

from __future__ import annotations

import os
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from parity import batches, rank_slice

transformers = pytest.importorskip("transformers")

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _hf_model(tmp_path, tied=False, shard="60KB", head_dim=None):
    """A transformers Llama saved in `tmp_path`; `head_dim` set apart from hidden / heads = 16 where given (the
    form of Mistral Nemo and NVIDIA's width-pruned Minitron Llamas)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tied, head_dim=head_dim)
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = tmp_path / (("hf-tied" if tied else "hf") + (f"-head-dim-{head_dim}" if head_dim else ""))
    model.save_pretrained(out, max_shard_size=shard)
    return model, out


@pytest.mark.parametrize("tied,head_dim", [(False, None), (True, None), (False, 24)])
def test_hugging_face_round_trip_keeps_the_logits(tmp_path, tied, head_dim):
    from bunsan.models.hf import load_llama, save_llama
    hf, path = _hf_model(tmp_path, tied, head_dim=head_dim)
    assert (path / "model.safetensors.index.json").is_file() or tied   # sharded with an index
    ours = load_llama(path).eval()
    assert ours.config.head_dim == hf.config.head_dim and ours.config.attention_dim == 4 * hf.config.head_dim
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(ours(ids), want, rtol=1e-5, atol=1e-5)
        out = save_llama(ours.state_dict(), ours.config, tmp_path / "export", max_shard_bytes=50_000)
        back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(back(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert back.config.head_dim == hf.config.head_dim


def _load_hf(rank, world, path, cfg):
    import bunsan
    from bunsan.checkpoint.hf import load_hf_into_engine
    from bunsan.models.hf import read_config
    with torch.device("meta"):
        model = bunsan.models.Llama(read_config(path))
    if cfg.get("pipeline", {}).get("stages", 1) == 1 and cfg["zero_optimization"]["stage"] < 3:
        model.to_empty(device="cpu")
        model.init_weights()
    engine = bunsan.initialize(model, cfg)
    load_hf_into_engine(engine, path)
    state = engine.consolidated_state_dict()
    loss = engine.eval_batch(rank_slice(batches(1, 4)[0], engine.dp_rank, engine.dp_size))
    return state, loss


@pytest.mark.parametrize("cfg,head_dim", [
    ({"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 0}}, None),
    ({"tensor_parallel": {"size": 2}, "zero_optimization": {"stage": 0}}, 24),
    ({"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}, None),
    ({"zero_optimization": {"stage": 3}}, None),
], ids=["tp2", "tp2-head-dim-apart", "pp2", "zero3"])
def test_hugging_face_weights_load_into_any_layout(pools, tmp_path, cfg, head_dim):
    from bunsan.models.hf import load_llama
    hf, path = _hf_model(tmp_path, tied=True, head_dim=head_dim)
    cfg = {"train_batch_size": 4, **cfg, "train": {"timeout_s": 60}}
    plain = load_llama(path).state_dict()
    data = batches(1, 4)[0]
    with torch.no_grad():
        logits = hf(data["input_ids"]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), data["labels"].reshape(-1)).item()
    for state, loss in pools.run(2, _load_hf, 2, str(path), cfg):
        for k, v in plain.items():
            if k.startswith("rope_"):
                continue
            torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
        assert loss == pytest.approx(want, rel=1e-5)


FAULTY = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import bunsan.engine.engine as engine
    train_batch = engine.Engine.train_batch
    marker = Path(__file__).with_name("killed")
    def dying(self, batch):
        out = train_batch(self, batch)
        if self.global_step == 3 and self.mesh.rank == 1 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)   # after step 3, before its checkpoint: once
        return out
    engine.Engine.train_batch = dying
    from bunsan.cli.main import main
    sys.exit(main(sys.argv[1:]))
""")


def _train_args(tmp_path, corpus, name):
    out = tmp_path / name
    # --timeout only catches a hang: torchrun's agent restarts on the kill itself; the same timeout bounds the
    # restarted ranks' set-up, which two busy processes beside the suite can stretch past 20 s
    return ["train", "--preset", "tiny", "--steps", "6", "--micro-batch", "2", "--seq-len", "64", "--zero", "2",
            "--data", str(corpus / "*.py"), "--output", str(out), "--checkpoint-dir", str(out / "ckpt"),
            "--save-interval", "1", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "steps_per_print=1",
            "--set", "data.val_fraction=0", "--timeout", "120"], out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import argparse
    import inspect
    import json
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (json, argparse)))
    return d


RESTARTS = 5


@pytest.mark.e2e         # a rank SIGKILLed and torchrun's restart of the job
def test_a_killed_rank_resumes_and_ends_like_an_uninterrupted_run(pools, tmp_path, corpus):
    """torchrun restarts the job after a rank is killed; it resumes from its newest whole checkpoint and ends
    bit-equal to an uninterrupted run, RESTARTS times in a row (bunsan run makes each rendezvous round use a
    fresh store: cli/launch.py)."""
    args, whole = _train_args(tmp_path, corpus, "whole")
    ranks = pools.cli(2, args + ["--nproc", "2"], cwd=tmp_path)      # (the uninterrupted run needs no launch)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    a = load_file(str(whole / "final" / "model.safetensors"))
    for attempt in range(RESTARTS):
        run = tmp_path / f"restart{attempt}"
        run.mkdir()
        script = run / "faulty.py"
        script.write_text(FAULTY)
        args, broken = _train_args(run, corpus, "broken")
        r = subprocess.run([sys.executable, "-m", "bunsan.cli", "run", "--nproc-per-node", "2", "--max-restarts",
                            "1", str(script)] + args, capture_output=True, text=True, timeout=240, env=ENV, cwd=run)
        logs = r.stdout + r.stderr
        assert r.returncode == 0, f"restart {attempt + 1} of {RESTARTS} failed:\n{logs}"
        assert (run / "killed").exists()
        assert "resumed from" in logs and "global_step2" in logs   # killed after step 3, before saving it
        records = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records if "loss" in r]
        assert steps == sorted(set(steps)) and steps[0] == 1          # one continuous history, nothing twice
        assert [r["step"] for r in records if r.get("event") == "resumed"] == [2]
        b = load_file(str(broken / "final" / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (attempt, k)


def _save_for_convert(rank, world, root):
    import bunsan
    from parity import optimizer_config, tiny_model
    engine = bunsan.initialize(tiny_model(0, tie_word_embeddings=True),
                               {"train_batch_size": 4, "zero_optimization": {"stage": 3},
                                "tensor_parallel": {"size": 2}, "optimizer": optimizer_config("adamw")})
    engine.train_batch(rank_slice(batches(1, 4)[0], engine.dp_rank, engine.dp_size))
    engine.save_checkpoint(root)
    return {k: v.float() for k, v in engine.consolidated_state_dict().items()}


def test_convert_consolidates_any_layout(pools, tmp_path):
    from bunsan.cli.main import main
    want = pools.run(4, _save_for_convert, 4, str(tmp_path / "ckpt"))[0]
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "one.safetensors")]) == 0
    got = load_file(str(tmp_path / "one.safetensors"))
    for k, v in got.items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf.model.embed_tokens.weight, want["embed_tokens.weight"])
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "x.safetensors")]) == 2


def test_fine_tuning_a_hugging_face_checkpoint_end_to_end(pools, tmp_path, corpus):
    hf, path = _hf_model(tmp_path, tied=False)
    out = tmp_path / "tuned"
    ranks = pools.cli(2, ["train", "--nproc", "2", "--init-from", path, "--steps", "3", "--micro-batch", "2",
                          "--seq-len", "64", "--zero", "1", "--lr", "1e-3", "--data", corpus / "*.py", "--output", out,
                          "--set", f"data.cache_dir={tmp_path / 'c'}", "--set", "steps_per_print=1",
                          "--set", "data.val_fraction=0"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    tuned = load_file(str(out / "final" / "model.safetensors"))     # transformers' names, as HF's own
    start = hf.state_dict()
    moved = [k for k in start if not torch.equal(tuned[k], start[k])]
    # Three small steps from HF's weights: every tensor within 0.05 of where HF left it (bunsan's own init
    # would be ~0.02-std noise away from it everywhere), and training moved them.
    assert moved and all((tuned[k] - start[k]).abs().max() < 0.05 for k in start)
