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

Gradient accumulation (gas=N: two epochs of 5 micro-batches, so that each epoch ends on a shorter accumulation
whose boundary the Trainer sets through accelerate; the Trainer scales the loss itself, scale_wrt_gas=False):
pairwise over stage x accumulation, fp32 (transformers refuses `bf16=True` on a CPU unless use_cpu=True, which
turns DeepSpeed off: the bf16 cases need a GPU; test_deepspeed_accumulation.py checks bunsan's bf16 under
accelerate's boundaries on the CPU). Evaluation during training runs with one rank: on a CPU accelerate counts
one process under DeepSpeed (above), so its gather of the evaluation losses over two ranks fails in accelerate
itself, DeepSpeed's as bunsan's.
  case                   stage  gas  dtype  ranks  why
  accumulates as without   0     2    fp32   2      pairwise
  accumulates as without   0     4    fp32   2      pairwise
  accumulates as without   1     1    fp32   2      pairwise (gas 1 at stages 2, 3: the cases above)
  accumulates as without   1     4    fp32   2      pairwise
  accumulates as without   2     2    fp32   2      broke before (the boundary accelerate sets: issue #63)
  accumulates as without   3     2    fp32   2      broke before (as stage 2)
  evaluates as without     0     1    fp32   1      evaluation during training
  evaluates as without     1     2    fp32   1      evaluation, gas x stage pairs
  evaluates as without     3     4    fp32   1      evaluation under ZeRO-3 (the forward gathers)
  bf16 (GPU)               2     4    bf16   2      the dtype axis, where transformers allows it
  bf16 (GPU)               3     2    bf16   2      as above
  resumes in epoch 2       2     2    fp32   2      resume with an uneven epoch (the Trainer skips batches)
  resumes in epoch 2       3     4    fp32   2      as above, ZeRO-3
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    out = {optim: _run(ranks, tmp, "none", "hf", optim) for optim in ("adamw", "sgd")}
    ranks.discard(1)    # its ranks imported transformers' DeepSpeed integration without DeepSpeed: not reusable
    return out


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


ACCUMULATED = [("0", 2, 2), ("0", 4, 2), ("1", 1, 2), ("1", 4, 2), ("2", 2, 2), ("3", 2, 2),
               ("0", 1, 1), ("1", 2, 1), ("3", 4, 1)]


@pytest.fixture(scope="module")
def accumulated_reference(ranks, tmp_path_factory) -> dict[int, dict]:
    """gas -> the Trainer without DeepSpeed over the same two epochs, with its evaluations."""
    out = {}
    for gas in (1, 2, 4):
        tmp = tmp_path_factory.mktemp(f"plain-gas{gas}")
        results = ranks.run(1, hf_trainer_script.rank_job, [str(tmp / "out.json"), "none", "hf", "adamw",
                                                             f"gas={gas}", "eval=1"])
        out[gas] = results[0]
    ranks.discard(1)    # as `reference`'s
    return out


@pytest.mark.parametrize("stage,gas,world", ACCUMULATED)
def test_trainer_with_deepspeed_accumulates_as_without(ranks, tmp_path, accumulated_reference, stage, gas, world):
    """Every step where the Trainer without DeepSpeed steps (an epoch's shorter last accumulation included),
    each loss, rate and evaluation equal to it."""
    evaluate = world == 1
    results = ranks.run(world, hf_trainer_script.rank_job, [str(tmp_path / "out.json"), stage, "hf", "adamw",
                                                            f"gas={gas}", f"eval={int(evaluate)}"])
    run, plain = results[0], accumulated_reference[gas]
    assert run["steps"] == plain["steps"] == list(range(1, 2 * -(-5 // gas) + 1))
    assert run["lrs"] == pytest.approx(plain["lrs"], rel=1e-12)
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    if evaluate:
        assert len(run["eval_losses"]) == len(plain["eval_losses"]) > 0
        assert run["eval_losses"] == pytest.approx(plain["eval_losses"], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: transformers refuses TrainingArguments("
                    "bf16=True) on a CPU unless use_cpu=True, which turns DeepSpeed off")
@pytest.mark.parametrize("stage,gas", [("2", 4), ("3", 2)])
def test_trainer_with_deepspeed_accumulates_in_bf16(ranks, tmp_path, accumulated_reference, stage, gas):
    """bf16 weights and an fp32 master copy: the steps and rates of the fp32 run, losses to bf16's precision."""
    results = ranks.run(2, hf_trainer_script.rank_job, [str(tmp_path / "out.json"), stage, "hf", "adamw",
                                                        f"gas={gas}", "dtype=bf16"])
    run, plain = results[0], accumulated_reference[gas]
    assert run["steps"] == plain["steps"] and run["lrs"] == pytest.approx(plain["lrs"], rel=1e-12)
    assert run["losses"] == pytest.approx(plain["losses"], rel=3e-2)


@pytest.mark.parametrize("stage,gas", [("2", 2), ("3", 4)])
def test_trainer_resumes_an_accumulating_run_in_its_second_epoch(ranks, tmp_path, accumulated_reference, stage, gas):
    """Stopped and saved after the first half of the steps plus one (in epoch 2, whose first batches the resumed
    Trainer skips), resumed in other ranks into other weights: every loss of the run never stopped."""
    run_dir = str(tmp_path / "run")
    first = ranks.run(2, hf_trainer_script.rank_job, [str(tmp_path / "first.json"), stage, "hf", "adamw",
                                                      f"gas={gas}", "save", run_dir])[0]
    ranks.discard(2)
    rest = ranks.run(2, hf_trainer_script.rank_job, [str(tmp_path / "rest.json"), stage, "hf", "adamw",
                                                     f"gas={gas}", "resume", run_dir])[0]
    plain = accumulated_reference[gas]
    stopped = len(first["losses"])
    assert stopped == len(plain["losses"]) // 2 + 1
    assert rest["steps"] == plain["steps"]            # the log history comes back with the checkpoint
    assert rest["losses"][:stopped] == first["losses"]
    assert first["losses"] + rest["losses"][stopped:] == pytest.approx(plain["losses"], rel=1e-5)


ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  zero_stage: 2
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
num_machines: 1
num_processes: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: false
"""


@pytest.mark.e2e
def test_accelerate_launch_with_a_deepspeed_plugin_config(tmp_path, accumulated_reference):
    """`accelerate launch --config_file` with `distributed_type: DEEPSPEED` (the plugin's ZeRO-2 and accumulation
    2; no `deepspeed=` in TrainingArguments), through bunsan's accelerate_launch: the losses, rates and
    evaluations of the Trainer without DeepSpeed. One process: on a CPU accelerate's plugin counts one process
    whatever the launch (see the docstring), so its train_batch_size would not fit two ranks."""
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_CONFIG)
    out = tmp_path / "out.json"
    env = {**os.environ, **hf_trainer_script.JOB_ENV}
    proc = subprocess.run([sys.executable, "-m", "bunsan.deepspeed.accelerate_launch", "--config_file",
                           str(tmp_path / "accelerate.yaml"), "--main_process_port", str(free_port()), str(SCRIPT),
                           str(out), "2", "hf", "adamw", "gas=2", "eval=1", "plugin=1"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    run, plain = json.loads(out.read_text()), accumulated_reference[2]
    assert run["steps"] == plain["steps"]
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert run["eval_losses"] == pytest.approx(plain["eval_losses"], rel=1e-5)


def test_accelerate_launch_refuses_deepspeeds_own_multinode_runner():
    """accelerate would run DeepSpeed's `deepspeed` command (pdsh over a hostfile): refused with the fix."""
    from bunsan.deepspeed.accelerate_launch import main
    with pytest.raises(SystemExit, match="launcher .pdsh. on 2 machines.*standard"):
        main(["--use_deepspeed", "--num_machines", "2", "--deepspeed_multinode_launcher", "pdsh", "x.py"])
    from bunsan.deepspeed.alias import installed
    assert not installed()        # refused before `import deepspeed` was made bunsan's in this process
