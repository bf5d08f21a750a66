"""transformers' Trainer with `TrainingArguments(deepspeed=config)` runs on bunsan after one line,
`bunsan.deepspeed.install()`, and trains as the same Trainer without DeepSpeed (fp32, rtol 1e-5).

The reference is the Trainer in one process: on the CPU accelerate counts one process under DeepSpeed (with
DeepSpeed itself too), so each of the two ranks reads the whole dataset in the same order and the averaged
gradient is one process's. On GPUs each rank reads its own share, as for DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from node_harness import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("hf_trainer_script.py")


def _run(tmp_path: Path, stage: str, source: str, optim: str, *extra: str) -> list[float]:
    out = tmp_path / f"{stage}-{source}-{optim}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
    launch = [sys.executable] if stage == "none" else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(SCRIPT), str(out), stage, source, optim, *extra], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())["losses"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("plain")
    return {optim: _run(tmp, "none", "hf", optim) for optim in ("adamw", "sgd")}


@pytest.mark.parametrize("stage,source,optim", [("2", "hf", "adamw"), ("3", "hf", "adamw"), ("2", "config", "adamw"),
                                                ("3", "hf", "sgd"), ("2", "hf", "sgd")])
def test_trainer_with_deepspeed_trains_as_without(tmp_path, reference, stage, source, optim):
    losses = _run(tmp_path, stage, source, optim)
    assert len(losses) == 5
    assert losses == pytest.approx(reference[optim], rel=1e-5)
    assert losses[-1] != losses[0]


@pytest.mark.parametrize("stage,source", [("2", "hf"), ("3", "hf"), ("2", "config")])
def test_trainer_resumes_from_its_deepspeed_checkpoint_exactly(tmp_path, reference, stage, source):
    """Saved at step 3 (the model's weights and DeepSpeed's checkpoint), resumed into a model of other weights:
    steps 4-5 as the run that was never stopped (the optimizer's state and the rate its schedule reached come
    back; DeepSpeed 0.19.8 gave the same 5 losses to 1e-7 in a side run). The config's optimizer decays every
    weight, unlike the Trainer's own, so its reference is the same config's whole run."""
    run = str(tmp_path / "run")
    whole = reference["adamw"] if source == "hf" else _run(tmp_path, stage, source, "adamw")
    first = _run(tmp_path, stage, source, "adamw", "save", run)
    (tmp_path / f"{stage}-{source}-adamw.json").unlink()
    rest = _run(tmp_path, stage, source, "adamw", "resume", run)
    assert first + rest[-2:] == pytest.approx(whole, rel=1e-5)


def test_trainer_takes_the_config_as_a_file(tmp_path, reference):
    losses = _run(tmp_path, "3", "config", "adamw", str(tmp_path / "ds_config.json"))
    assert losses == pytest.approx(reference["adamw"], rel=1e-5)
