"""transformers' Trainer with `TrainingArguments(deepspeed=config)` runs on bunsan after one line,
`bunsan.deepspeed.install()`, and trains as the same Trainer without DeepSpeed (fp32, rtol 1e-5).

The reference is the Trainer in one process: on the CPU accelerate counts one process under DeepSpeed (with
DeepSpeed itself too), so each of the two ranks reads the whole dataset in the same order and the averaged
gradient is one process's. On GPUs each rank reads its own share, as for DDP.

The script (hf_trainer_script.py) runs as a job of the harness's ranks, which carry torchrun's environment and a
gloo group already made; one case launches it with torchrun as its users do (e2e), where accelerate makes the
group itself.

The matrix: pairwise over stage x optimizer's source x optimizer (a config's optimizer is AdamW), every resume
case (each broke before: the optimizer's state and the schedule's rate after a resume), and the config as a file.
  case                        stage  source  optim  why
  trains as without           2      hf      adamw  pairwise
  trains as without           3      hf      adamw  pairwise (hf x adamw at stage 3)
  trains as without           2      config  adamw  pairwise
  trains as without           3      hf      sgd    pairwise
  trains as without           2      hf      sgd    pairwise
  resumes exactly             2      hf      adamw  broke before (optimizer state after resume, fixed in 5d3f775)
  resumes exactly             3      hf      adamw  broke before (as stage 2)
  resumes exactly             2      config  adamw  broke before (the config's optimizer: 5a364dc)
  config as a file, torchrun  3      config  adamw  pairwise (3 x config), the launch (e2e)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_trainer_script
from node_harness import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("hf_trainer_script.py")


@pytest.fixture(scope="module")
def ranks(pools):
    """The harness's pools, fresh before this module (a rank that imported accelerate before `install()` would
    not see DeepSpeed) and after it (its ranks keep `import deepspeed` aliased to bunsan: others' must not)."""
    for world in (1, 2):
        pools.discard(world)
    yield pools
    for world in (1, 2):
        pools.discard(world)


def _run(ranks, tmp_path: Path, stage: str, source: str, optim: str, *extra: str) -> list[float]:
    """The script on harness ranks: two with a stage (torchrun's workers), one without (`python script.py`)."""
    out = tmp_path / f"{stage}-{source}-{optim}.json"
    results = ranks.run(1 if stage == "none" else 2, hf_trainer_script.rank_job,
                        [str(out), stage, source, optim, *extra])
    assert results[0] == json.loads(out.read_text())       # rank 0 (the Trainer's process 0) wrote it
    return results[0]["losses"]


@pytest.fixture(scope="module")
def reference(ranks, tmp_path_factory) -> dict[str, list[float]]:
    tmp = tmp_path_factory.mktemp("plain")
    return {optim: _run(ranks, tmp, "none", "hf", optim) for optim in ("adamw", "sgd")}


@pytest.fixture(scope="module")
def whole_runs(ranks, tmp_path_factory) -> dict:
    """(stage, source, optim) -> the 5 losses of a run never stopped (a resume case's reference as well)."""
    runs: dict = {}

    def run(stage: str, source: str, optim: str) -> list[float]:
        if (stage, source, optim) not in runs:
            runs[stage, source, optim] = _run(ranks, tmp_path_factory.mktemp("whole"), stage, source, optim)
        return runs[stage, source, optim]
    return run


@pytest.mark.parametrize("stage,source,optim", [("2", "hf", "adamw"), ("3", "hf", "adamw"), ("2", "config", "adamw"),
                                                ("3", "hf", "sgd"), ("2", "hf", "sgd")])
def test_trainer_with_deepspeed_trains_as_without(whole_runs, reference, stage, source, optim):
    losses = whole_runs(stage, source, optim)
    assert len(losses) == 5
    assert losses == pytest.approx(reference[optim], rel=1e-5)
    assert losses[-1] != losses[0]


RESUMED = [("2", "hf"), ("3", "hf"), ("2", "config")]


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> dict:
    """Every resume case's run stopped after step 3 and saved; then fresh ranks, so that each resume runs in other
    processes than its save (nothing of the first run is left in memory), one pool start for all three."""
    out = {}
    for stage, source in RESUMED:
        tmp = tmp_path_factory.mktemp(f"resume-{stage}-{source}")
        out[stage, source] = (tmp, _run(ranks, tmp, stage, source, "adamw", "save", str(tmp / "run")))
        (tmp / f"{stage}-{source}-adamw.json").unlink()
    ranks.discard(2)
    return out


@pytest.mark.parametrize("stage,source", RESUMED)
def test_trainer_resumes_from_its_deepspeed_checkpoint_exactly(ranks, whole_runs, saved, reference, stage, source):
    """Saved at step 3 (the model's weights and DeepSpeed's checkpoint), resumed into a model of other weights:
    steps 4-5 as the run that was never stopped (the optimizer's state and the rate its schedule reached come
    back; DeepSpeed 0.19.8 gave the same 5 losses to 1e-7 in a side run). The config's optimizer decays every
    weight, unlike the Trainer's own, so its reference is the same config's whole run."""
    whole = reference["adamw"] if source == "hf" else whole_runs(stage, source, "adamw")
    tmp, first = saved[stage, source]
    rest = _run(ranks, tmp, stage, source, "adamw", "resume", str(tmp / "run"))
    assert first + rest[-2:] == pytest.approx(whole, rel=1e-5)


@pytest.mark.e2e
def test_trainer_under_torchrun_takes_the_config_as_a_file(tmp_path, reference):
    """The launch its users make: torchrun starts the script, accelerate makes the process group through
    deepspeed.init_distributed (bunsan's), and the config is a JSON file's path."""
    out = tmp_path / "3-config-adamw.json"
    env = {**os.environ, **hf_trainer_script.JOB_ENV}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    proc = subprocess.run([*launch, str(SCRIPT), str(out), "3", "config", "adamw", str(tmp_path / "ds_config.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads(out.read_text())["losses"] == pytest.approx(reference["adamw"], rel=1e-5)
