"""The doctor, provoked on CPU: a batch too big for a memory cap, a rank that stays away from a collective, a
slowed collective, and `bunsan doctor`'s checks. No test reads a clock to decide: a rank stays away until its peer
has its error (a file written), and the slowed collectives advance a clock of the test's own.

Old test                                                   now
test_bunsan_doctor_checks_the_machine_and_the_config       itself (its processes, e2e) and
                                                           test_bunsan_doctor_names_the_way_out_of_a_model_that_...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_harness import Pool
from parity import batches, rank_slice, tiny_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}

def _cap_memory():                      # in the child, before it starts: 3 GiB of data segment
    import resource
    resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, resource.RLIM_INFINITY))


@pytest.mark.e2e         # a memory cap set on a process of its own (preexec_fn)
def test_out_of_memory_says_where_what_and_what_would_fit(tmp_path):
    """`bunsan train` with a batch far too big for a memory cap: the doctor's message and exit code 3."""
    r = subprocess.run([sys.executable, "-m", "bunsan.cli", "train", "--nproc", "1", "--preset", "tiny", "--steps",
                        "2", "--micro-batch", "512", "--seq-len", "512", "--output", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path, preexec_fn=_cap_memory)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert "out of memory at step 1" in out and ("forward" in out or "backward" in out)
    assert "held then: params" in out and "RLIMIT_DATA" in out
    assert "predicted for this layout (dp1 tp1 zero0 mb512x1" in out
    assert "layouts that fit" in out and "micro_batch 512 ->" in out      # fewer rows per micro-batch


def _until(path: Path, ceiling_s: float = 120) -> None:
    """Wait for `path` to be written (the ceiling only catches a hang)."""
    deadline = time.monotonic() + ceiling_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was never written")
        time.sleep(0.05)


def _away(rank, world, done):
    import bunsan
    from bunsan.comm.collectives import CommError
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train": {"timeout_s": 3}}
    engine = bunsan.initialize(tiny_model(0), cfg)
    data = batches(2, 4, seq=8)
    engine.train_batch(rank_slice(data[0], engine.dp_rank, engine.dp_size))
    if rank == 1:
        _until(Path(done))             # away through rank 0's timeout and its roll call, until it has its error
        return "stayed away"
    try:
        engine.train_batch(rank_slice(data[1], engine.dp_rank, engine.dp_size))
    except CommError as e:
        return str(e)
    finally:
        Path(done).touch()
    return "no error"


def test_a_rank_that_does_not_come_is_named_with_every_ranks_last_step(tmp_path):
    pool = Pool(2)                     # its own processes: a timed-out group is not reused
    try:
        msg, away = pool.run(_away, 2, str(tmp_path / "rank 0 has its error"), timeout=120)
    finally:
        pool.close(force=True)
    assert away == "stayed away"
    assert "all_reduce #" in msg and ("group 'dp'" in msg or "group 'world'" in msg), msg
    assert "ranks [1] did not arrive" in msg, msg
    assert "rank 1 did not answer" in msg and "last step finished: rank 0: 1, rank 1: 1" in msg, msg


STEP_S = 0.1        # what each step's computation takes on the test's clock


def _slowed(rank, world, delay):
    """Three steps whose every collective waits `delay` and whose computation takes STEP_S, on a clock of the
    test's own (the wait clock reads it): (collectives of the last two steps, their wait, their time, the
    doctor's (share, advice))."""
    import types
    import bunsan
    from bunsan.comm import collectives as comm, stats
    from bunsan.config.root import Config
    from bunsan.doctor.slow import comm_advice
    now, calls = [0.0], [0]
    original, real_time = comm.Comm._run, stats.time

    def slow_run(self, op, group, nbytes, fn, *rest):
        def waited():
            now[0] += delay
            calls[0] += 1
            return fn()
        return original(self, op, group, nbytes, waited, *rest)
    comm.Comm._run = slow_run
    stats.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    try:
        cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000}}
        engine = bunsan.initialize(tiny_model(0), cfg)
        data = batches(3, 4, seq=8)
        engine.train_batch(rank_slice(data[0], engine.dp_rank, engine.dp_size))
        wait0, t0, calls0 = engine.comm.wait_s, now[0], calls[0]
        for b in data[1:]:
            engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size))
            now[0] += STEP_S
        waited, took = engine.comm.wait_s - wait0, now[0] - t0
        return calls[0] - calls0, waited, took, comm_advice(Config.load(cfg), waited, took, world,
                                                             engine.module.config, "cpu")
    finally:
        comm.Comm._run = original
        stats.time = real_time


def test_slow_synchronisation_is_called_out_with_what_to_change(pools):
    calls, waited, took, (share, advice) = pools.run(2, _slowed, 2, 0.05)[0]
    assert calls > 0 and waited == pytest.approx(calls * 0.05)       # every collective's wait is counted
    assert share == pytest.approx(waited / took) and share > 0.3 and advice is not None
    assert "waiting for communication" in advice and "reduce_bucket_size (now 20,000" in advice
    assert "bunsan plan" in advice            # its first layout for 2 processes, or the command to ask it
    calls, waited, took, (share, advice) = pools.run(2, _slowed, 2, 0.0)[0]
    assert waited == 0 and took == pytest.approx(2 * STEP_S)
    assert share == 0 and advice is None          # unslowed: quiet


@pytest.mark.e2e         # the doctor starts (spawns) its own two processes
def test_bunsan_doctor_checks_the_machine_and_the_config(tmp_path, capsys):
    from bunsan.cli.main import main
    # (--timeout: how long the doctor lets its processes take to join, generous on a busy machine)
    assert main(["doctor", "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    for line in ("torch", "backends", "host", "ranks (gloo)", "2 processes joined", "config", "disk"):
        assert line in out, line


def test_bunsan_doctor_names_the_way_out_of_a_model_that_does_not_fit(capsys):
    from bunsan.cli.main import main
    # a model far too big for this machine: the config check fails and names the way out
    assert main(["doctor", "--nproc", "1", "--model", "llama-70b"]) == 1
    out = capsys.readouterr().out
    assert "fail" in out and "does not fit" in out and "bunsan plan --model" in out


def _doctor_as_launched(rank, world, argv):
    """`bunsan doctor` on ranks a launcher started: the doctor makes their group itself (from the environment
    torchrun sets, as the pool's ranks have it), so the pool's own goes first (the pool makes it again after)."""
    import torch.distributed as dist
    from dist_harness import cli_job
    dist.destroy_process_group()
    return cli_job(rank, argv)


def test_bunsan_doctor_under_a_launcher_checks_the_launched_ranks(pools, tmp_path):
    ranks = pools.run(2, _doctor_as_launched, 2, ["doctor", "--checkpoint-dir", str(tmp_path)])
    assert [r.returncode for r in ranks] == [0, 0], ranks
    out = "".join(r.stdout for r in ranks)
    assert "2 ranks on 1 host(s)" in out and out.count("bunsan doctor") == 1   # rank 0 reports
