"""The doctor, provoked on CPU: a batch too big for a memory cap, a rank that sleeps through a collective, a
slowed collective, and `bunsan doctor`'s checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from dist_harness import Pool
from parity import batches, rank_slice, tiny_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}

def _cap_memory():                      # in the child, before it starts: 3 GiB of data segment
    import resource
    resource.setrlimit(resource.RLIMIT_DATA, (3 * 2**30, resource.RLIM_INFINITY))


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


def _sleeper(rank, world):
    import bunsan
    from bunsan.comm.collectives import CommError
    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train": {"timeout_s": 3}}
    engine = bunsan.initialize(tiny_model(0), cfg)
    data = batches(2, 4, seq=8)
    engine.train_batch(rank_slice(data[0], engine.dp_rank, engine.dp_size))
    if rank == 1:
        time.sleep(12)                 # through rank 0's timeout and its roll call
        return "slept"
    try:
        engine.train_batch(rank_slice(data[1], engine.dp_rank, engine.dp_size))
    except CommError as e:
        return str(e)
    return "no error"


def test_a_rank_that_does_not_come_is_named_with_every_ranks_last_step():
    pool = Pool(2)                     # its own processes: a timed-out group is not reused
    try:
        msg, slept = pool.run(_sleeper, 2, timeout=120)
    finally:
        pool.close(force=True)
    assert slept == "slept"
    assert "all_reduce #" in msg and ("group 'dp'" in msg or "group 'world'" in msg), msg
    assert "ranks [1] did not arrive" in msg, msg
    assert "rank 1 did not answer" in msg and "last step finished: rank 0: 1, rank 1: 1" in msg, msg


def _slowed(rank, world, delay):
    import bunsan
    from bunsan.comm import collectives as comm
    from bunsan.config.root import Config
    from bunsan.doctor.slow import comm_advice
    original = comm.Comm._run

    def slow_run(self, op, group, nbytes, fn, async_op):     # every collective takes `delay` longer
        return original(self, op, group, nbytes, lambda: (time.sleep(delay), fn())[1], async_op)
    comm.Comm._run = slow_run
    try:
        cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": 20_000}}
        engine = bunsan.initialize(tiny_model(0), cfg)
        data = batches(3, 4, seq=8)
        engine.train_batch(rank_slice(data[0], engine.dp_rank, engine.dp_size))
        wait0, t0 = engine.comm.wait_s, time.perf_counter()
        for b in data[1:]:
            engine.train_batch(rank_slice(b, engine.dp_rank, engine.dp_size))
        return comm_advice(Config.load(cfg), engine.comm.wait_s - wait0, time.perf_counter() - t0, world,
                           engine.module.config, "cpu")
    finally:
        comm.Comm._run = original


def test_slow_synchronisation_is_called_out_with_what_to_change(pools):
    share, advice = pools.run(2, _slowed, 2, 0.05)[0]
    assert share > 0.3 and advice is not None
    assert "waiting for communication" in advice and "reduce_bucket_size (now 20,000" in advice
    assert "bunsan plan" in advice            # its first layout for 2 processes, or the command to ask it
    share, advice = pools.run(2, _slowed, 2, 0.0)[0]
    assert advice is None or share > 0.3          # unslowed: quiet unless the machine itself is that slow


def test_bunsan_doctor_checks_the_machine_and_the_config(tmp_path, capsys):
    from bunsan.cli.main import main
    assert main(["doctor", "--nproc", "2", "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    for line in ("torch", "backends", "host", "ranks (gloo)", "2 processes joined", "config", "disk"):
        assert line in out, line
    # a model far too big for this machine: the config check fails and names the way out
    assert main(["doctor", "--nproc", "1", "--model", "llama-70b"]) == 1
    out = capsys.readouterr().out
    assert "fail" in out and "does not fit" in out and "bunsan plan --model" in out


def test_bunsan_doctor_under_a_launcher_checks_the_launched_ranks(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bunsan.cli", "run", "--nproc-per-node", "2", "-m", "bunsan.cli",
                        "doctor", "--checkpoint-dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=ENV, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 ranks on 1 host(s)" in r.stdout and r.stdout.count("bunsan doctor") == 1   # rank 0 reports
