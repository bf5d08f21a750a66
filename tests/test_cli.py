"""The command line: `bunsan train` on 2 processes, `bunsan generate` on its output, `bunsan run`, errors.

What a command produces is checked on the ranks of a pool (`pools.cli`: the workers' part of `train --nproc 2`
and `generate --tp 2` as torchrun would start it); the launches themselves (torchrun, the console entry, `bunsan
run`) are the end-to-end tests at the end, one per command.

Old test (all real processes before)                      now
test_errors_are_one_message_without_tracebacks[tp 3]       its pool case (each rank's one line), and the launcher
                                                           saying it once: test_train_launches_through_torchrun
test_the_command_line_runs_it (test_config_explain.py)     test_config_launches
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BUNSAN = [sys.executable, "-m", "bunsan.cli"]


def _run(args, cwd, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(BUNSAN + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import json as j
    import argparse as a
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (j, a)))
    return d


def _said(ranks) -> str:
    """Every rank's output, as torchrun's console shows it."""
    return "".join(r.stdout + r.stderr for r in ranks)


@pytest.fixture(scope="module")
def trained(pools, tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("train")
    ranks = pools.cli(2, ["train", "--nproc", "2", "--preset", "tiny", "--steps", "4", "--micro-batch", "2",
                          "--seq-len", "64", "--zero", "3", "--data", corpus / "*.py", "--output", out,
                          "--set", f"data.cache_dir={out / 'cache'}", "--set", "steps_per_print=2",
                          "--set", "zero_optimization.stage3_param_persistence_threshold=0"], cwd=out)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    return out


def test_train_writes_metrics_weights_and_summary(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 4]
    assert any("val_loss" in r for r in records)          # held-out loss at the end
    last = train[-1]
    for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "comm_bytes", "memory"):
        assert key in last
    mem = last["memory"][0]
    assert len(last["memory"]) == 2
    assert mem["theory_model_states"] <= mem["model_states"] <= 1.05 * mem["theory_model_states"]
    assert last["comm_bytes"] > 0
    state = load_file(str(trained / "final" / "model.safetensors"))    # transformers' names
    assert "model.embed_tokens.weight" in state and "model.layers.0.self_attn.q_proj.weight" in state
    config = json.loads((trained / "final" / "config.json").read_text())
    assert config["hidden_size"] == 128 and config["model_type"] == "llama"
    assert json.loads((trained / "final" / "bunsan.json").read_text())["steps"] == 4


def test_the_trained_model_is_a_hugging_face_directory(trained):
    """final/ loads with transformers' own from_pretrained and computes what bunsan's model computes."""
    transformers = pytest.importorskip("transformers")
    from bunsan.cli.generate import trained_model
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained / "final").eval()
    ours, _ = trained_model(trained)
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)


def test_generate_continues_the_prompt(pools, trained):
    r = pools.cli(1, ["generate", "--checkpoint", trained, "--prompt", "def ", "--max-new-tokens", "16"],
                  cwd=trained)[0]
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout.rstrip("\n")) > 4


def test_tensor_parallel_generation_equals_one_process(pools, trained):
    args = ["generate", "--checkpoint", trained, "--prompt", "def ", "--max-new-tokens", "24"]
    one = pools.cli(1, args, cwd=trained)[0]
    two = pools.cli(2, args + ["--tp", "2"], cwd=trained)[0]
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout


def test_generate_top_k_sampling_is_seeded(pools, trained):
    args = ["generate", "--checkpoint", trained / "final", "--prompt", "import", "--max-new-tokens", "12",
            "--temperature", "1.0", "--top-k", "5", "--seed", "3"]
    assert pools.cli(1, args, cwd=trained)[0].stdout == pools.cli(1, args, cwd=trained)[0].stdout


def test_train_tensor_parallel_with_sequence_parallelism(pools, tmp_path, corpus):
    ranks = pools.cli(2, ["train", "--nproc", "2", "--tp", "2", "--sp", "--preset", "tiny", "--steps", "2",
                          "--micro-batch", "2", "--seq-len", "64", "--data", corpus / "*.py", "--output", tmp_path,
                          "--set", f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    meta = json.loads((tmp_path / "final" / "bunsan.json").read_text())
    assert meta["bunsan_config"]["tensor_parallel"] == {"size": 2, "sequence_parallel": True, "encoders": "split"}
    assert load_file(str(tmp_path / "final" / "model.safetensors"))["lm_head.weight"].shape == (256, 128)


def test_bad_config_is_reported_before_any_process_starts(pools, tmp_path):
    r = pools.cli(1, ["train", "--set", "zero_optimisation.stage=1"], cwd=tmp_path)[0]
    assert r.returncode == 2
    assert "did you mean 'zero_optimization'" in r.stderr


def test_train_pipeline_writes_the_timeline(pools, tmp_path, corpus):
    ranks = pools.cli(2, ["train", "--nproc", "2", "--pp", "2", "--schedule", "1f1b", "--grad-accum", "4",
                          "--preset", "tiny", "--steps", "2", "--micro-batch", "1", "--seq-len", "64",
                          "--data", corpus / "*.py", "--output", tmp_path,
                          "--set", f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0, 0], ranks
    assert "pipeline bubble" in _said(ranks) and "theory" in _said(ranks)
    text = (tmp_path / "timeline.txt").read_text()
    assert text.count("\n") >= 3 and "measured" in text and "1f1b, p=2, m=4" in text
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert "model.embed_tokens.weight" in state and "lm_head.weight" in state and "model.layers.3.mlp.up_proj.weight" in state


def test_unimplemented_feature_is_a_clear_error(pools, tmp_path, corpus):
    r = pools.cli(1, ["train", "--nproc", "1", "--set", "activation_checkpointing.cpu_checkpointing=true",
                      "--data", corpus / "*.py"], cwd=tmp_path)[0]
    assert r.returncode == 2 and "cpu_checkpointing" in r.stderr


def _refused_train(tmp_path, args) -> list[str]:
    return ["train", "--preset", "tiny", "--steps", "1", "--seq-len", "32", "--output", str(tmp_path),
            "--set", f"data.cache_dir={tmp_path / 'cache'}"] + args


@pytest.mark.parametrize("world, args, says", [
    (2, ["--nproc", "2", "--tp", "3"], "tensor"),   # every rank raises it (the launcher says it once: e2e below)
    (1, ["--nproc", "1", "--data", "/nonexistent/dir/*.txt"], "/nonexistent/dir"),
    (1, ["--nproc", "0"], "--nproc 0"),
])
def test_errors_are_one_message_without_tracebacks(pools, tmp_path, world, args, says):
    for r in pools.cli(world, _refused_train(tmp_path, args), cwd=tmp_path):
        assert r.returncode == 2, r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bunsan train")]
        assert len(lines) == 1 and says in lines[0], r.stderr


@pytest.mark.e2e     # torchrun's agent waiting at a real rendezvous
def test_a_missing_node_is_one_message_naming_what_to_check(tmp_path):
    (tmp_path / "one.py").write_text("print('never runs')\n")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run(["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=3", str(tmp_path / "one.py")], cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "did not all join the rendezvous" in r.stderr and "GLOO_SOCKET_IFNAME" in r.stderr


def test_bunsan_run_bounds_the_rendezvous_by_the_jobs_timeout(pools, tmp_path):
    """`bunsan run -m bunsan.cli train` reads the job's train.timeout_s for the rendezvous; keys the user gave to
    --rdzv-conf stay theirs; another script gets what train.timeout_s unset means."""
    from bunsan.cli.run import bounded_conf, setup_timeout
    from bunsan.comm.process_group import DEFAULT_TIMEOUT_S
    assert setup_timeout("bunsan.cli", True, ["train", "--preset", "tiny", "--timeout", "7.5"]) == (7.5, "train.timeout_s")
    seconds, source = setup_timeout("train.py", False, ["--timeout", "7.5"])
    import torch
    assert seconds == DEFAULT_TIMEOUT_S["nccl" if torch.cuda.is_available() else "gloo"] and "cannot read" in source
    conf, settings, added = bounded_conf("join_timeout=3,is_host=0", 7.5)
    assert settings == {"join_timeout": "3", "is_host": "0", "last_call_timeout": "8", "read_timeout": "8",
                        "timeout": "8"}
    assert added == {"last_call_timeout", "read_timeout", "timeout"}
    assert conf == "join_timeout=3,is_host=0,last_call_timeout=8,read_timeout=8,timeout=8"
    r = pools.cli(1, ["run", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "-m", "bunsan.cli", "train",
                      "--zero", "9"], cwd=tmp_path)[0]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr     # refused before waiting for any node
    assert r.stderr.strip().splitlines()[-1].startswith("bunsan train: "), r.stderr


def test_generate_on_a_missing_checkpoint(pools, tmp_path):
    r = pools.cli(1, ["generate", "--checkpoint", tmp_path], cwd=tmp_path)[0]
    assert r.returncode != 0 and "model.safetensors" in r.stderr


SCRIPT = """
import bunsan, torch
from parity import tiny_model
engine = bunsan.initialize(tiny_model(), {"train_micro_batch_size_per_gpu": 1})
print(f"rank {engine.dp_rank} of {engine.dp_size}", flush=True)
"""


# -- the launches: each command started as the user starts it --------------------------------------------------
@pytest.mark.e2e
def test_run_launches_a_script_on_two_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env_path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run(BUNSAN + ["run", "--nproc-per-node", "2", str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": env_path, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    assert "rank 0 of 2" in r.stdout and "rank 1 of 2" in r.stdout


@pytest.mark.e2e
def test_train_launches_through_torchrun(tmp_path, corpus):
    """`bunsan train --nproc 2` starts its two workers under torchrun, which train and write the run; a refusal
    every rank raises is said once, by the launcher, without a traceback."""
    out = tmp_path / "run"
    r = _run(["train", "--nproc", "2", "--preset", "tiny", "--steps", "1", "--micro-batch", "2", "--seq-len", "64",
              "--data", str(corpus / "*.py"), "--output", str(out), "--set", f"data.cache_dir={tmp_path / 'cache'}",
              "--set", "steps_per_print=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if "loss" in r][-1]["memory"]) == 2        # both processes reported
    assert json.loads((out / "final" / "bunsan.json").read_text())["steps"] == 1
    r = _run(_refused_train(tmp_path, ["--nproc", "2", "--tp", "3"]), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("bunsan train")]
    assert len(lines) == 1 and "tensor" in lines[0], r.stderr


@pytest.mark.e2e
def test_generate_launches(pools, trained):
    """`bunsan generate` in a process of its own writes what the pool's two tensor-parallel ranks write."""
    args = ["generate", "--checkpoint", str(trained), "--prompt", "def ", "--max-new-tokens", "24"]
    one = _run(args, cwd=trained)
    assert one.returncode == 0, one.stderr
    assert one.stdout == pools.cli(2, args + ["--tp", "2"], cwd=trained)[0].stdout


@pytest.mark.e2e
def test_convert_launches(tmp_path, trained):
    r = _run(["convert", str(trained), str(tmp_path / "hf"), "--to", "hf"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert state.keys() == load_file(str(trained / "final" / "model.safetensors")).keys()


@pytest.mark.e2e
def test_config_launches(tmp_path):
    r = _run(["config", "--explain", "zero_optimisation.stage"], cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "did you mean 'zero_optimization.stage'?" in r.stderr


@pytest.mark.parametrize("argv", [["run"], ["run", "--help"]])
def test_run_alone_or_with_help_prints_torchruns_usage(argv, capsys):
    from bunsan.cli.main import main
    assert main(argv) == 0
    assert "--nproc-per-node" in capsys.readouterr().out
