"""What the surviving side of a multi-node job sees when part of it is gone: a node's agent SIGKILLed alone (its
worker must end with it, the other node must not wait out torch's 300 s exit barrier), the node hosting the
stores killed whole, a node that never starts (from `bunsan run`, and from `bunsan train` launched by a
scheduler that sets RANK / WORLD_SIZE itself). Each ends within the job's timeout (train.timeout_s, --timeout)
plus start-up slack, with a bunsan message naming what is missing, and no Python traceback.

The simulated nodes are tests/node_harness.py's (PID, mount and UTS namespaces: skipped where not allowed);
`bunsan train` under a scheduler, and a worker ending with its agent on one machine, need none."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from node_harness import BUNSAN, ENV, Cluster, free_port, gone

SLACK = 45.0        # python and torch starting, torch's store connect retries, a loaded machine


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import argparse
    import inspect
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (json, argparse)))
    return d


def _train_args(corpus, out, cache, timeout, steps=3):
    return ["train", "--preset", "tiny", "--steps", str(steps), "--micro-batch", "2", "--seq-len", "64",
            "--data", str(corpus / "*.py"), "--output", str(out), "--set", f"data.cache_dir={cache}",
            "--set", "data.val_fraction=0", "--set", "steps_per_print=1", "--timeout", str(timeout)]


def _bunsan_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("bunsan ")]


def _training(cluster, corpus, out, timeout):
    """Both nodes training a run far longer than the test (it never ends by itself), once both are past step 1."""
    argv = BUNSAN + cluster.run_args() + ["-m", "bunsan.cli"] + \
        _train_args(corpus, out, cluster.local / "cache", timeout, steps=1_000_000)
    for node in range(2):
        cluster.start(node, argv)
    metrics = out / "metrics.jsonl"
    cluster.wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 180,
                       "training under way on both nodes")
    procs = [cluster.processes(n) for n in range(2)]
    assert all(len(p["agent"]) == 1 and len(p["workers"]) == 1 for p in procs), procs
    return procs


def test_an_agent_killed_alone_takes_its_worker_and_the_other_node_ends_within_the_timeout(tmp_path, corpus):
    timeout = 20
    with Cluster(tmp_path) as cluster:
        _, node1 = _training(cluster, corpus, tmp_path / "out", timeout)
        os.kill(node1["agent"][0], signal.SIGKILL)
        killed = time.monotonic()
        # PR_SET_PDEATHSIG (comm/launched.py): without it the worker trains on, an orphan, for ever
        cluster.wait_until(lambda: gone(node1["workers"]), 15, "node1's worker ending with its agent")
        code = cluster.wait(0, timeout + SLACK)
        assert time.monotonic() - killed < timeout + SLACK
        log = cluster.log(0)
    assert code != 0, log
    assert "Traceback" not in log, log
    lines = _bunsan_lines(log)
    # node0's worker names its lost peer (the roll call), its agent the failed process: nothing else
    assert any("rank 0" in line and "rank 1 did not answer" in line for line in lines), log
    assert lines[-1].startswith("bunsan run: 1 process(es) on node0 failed: rank 0 (exit 2)"), log


SLEEPER = """
import os, sys, time
from pathlib import Path
import bunsan
bunsan.init_distributed()          # under torchrun: where a worker binds itself to its agent
Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_worker_ends_with_its_agent_on_any_linux_machine(tmp_path):
    """The same bond without namespaces: the orphan is re-parented to whatever reaps here."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    pid_file = tmp_path / "worker.pid"
    agent = subprocess.Popen(BUNSAN + ["run", "--nproc-per-node", "1", str(tmp_path / "sleeper.py"), str(pid_file)],
                             env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    worker = None
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert agent.poll() is None, agent.communicate()[0]
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        agent.kill()
        agent.wait(30)
        deadline = time.monotonic() + 15
        while not gone([worker]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone([worker]), "the worker outlived its SIGKILLed agent"
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        if worker is not None and not gone([worker]):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_worker_whose_agent_died_before_the_bond_ends_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = os.readlink("/proc/self/ns/pid")
    survive = "from bunsan.comm.launched import die_with_agent\ndie_with_agent()\nprint('survived')"
    env = {**ENV, "TORCHELASTIC_RUN_ID": "test", "BUNSAN_AGENT_PID": f"{dead.pid}@{here}"}
    r = subprocess.run([sys.executable, "-c", survive], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and "survived" not in r.stdout, r.stdout + r.stderr
    assert f"the agent (pid {dead.pid}) that started this rank is gone" in r.stderr, r.stderr
    # an agent's pid from another PID namespace (a container wrapper between agent and worker) says nothing
    # about this one: no check, the worker lives
    env["BUNSAN_AGENT_PID"] = f"{dead.pid}@pid:[1]"
    r = subprocess.run([sys.executable, "-c", survive], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "survived" in r.stdout, r.stdout + r.stderr


def test_the_node_hosting_the_stores_killed_is_named_by_the_other_within_the_timeout(tmp_path, corpus):
    timeout = 20
    with Cluster(tmp_path) as cluster:
        _training(cluster, corpus, tmp_path / "out", timeout)
        cluster.kill_node(0)          # its agent hosts the rendezvous store, its worker rank 0's store
        killed = time.monotonic()
        code = cluster.wait(1, timeout + SLACK)
        assert time.monotonic() - killed < timeout + SLACK
        log = cluster.log(1)
    assert code != 0, log
    assert "Traceback" not in log, log
    # whichever notices first, node1's worker (its collective fails, then its roll call finds the store gone)
    # or its agent (the rendezvous store is gone), the message names the store on rank 0's node
    said = " ".join(_bunsan_lines(log))
    assert ("store on rank 0's node" in said and "died or was killed" in said) or \
        (f"rendezvous store at {cluster.endpoint}" in said and "the node of rank 0" in said), log


def test_a_node_that_never_starts_is_named_within_the_timeout(tmp_path, corpus):
    """Only node0 of --nnodes 2 starts; bunsan run's rendezvous join timeout comes from the job's --timeout."""
    timeout = 8
    with Cluster(tmp_path) as cluster:
        started = time.monotonic()
        cluster.start(0, BUNSAN + cluster.run_args() + ["-m", "bunsan.cli"] +
                      _train_args(corpus, tmp_path / "out", cluster.local / "cache", timeout))
        code = cluster.wait(0, timeout + SLACK)
        assert time.monotonic() - started < timeout + SLACK
        log = cluster.log(0)
    assert code == 1 and "Traceback" not in log, log
    assert _bunsan_lines(log) == [line for line in log.splitlines() if "did not all join" in line], log
    line = _bunsan_lines(log)[0]
    assert f"the 2 node(s) of --nnodes did not all join the rendezvous at {cluster.endpoint} within {timeout} s " \
           "(join_timeout, train.timeout_s)" in line and "this node (node0) did" in line, line
    assert "GLOO_SOCKET_IFNAME" in line and "resolves on every node" in line, line


def test_bunsan_train_under_a_scheduler_names_the_rank_that_never_came(tmp_path, corpus):
    """RANK / WORLD_SIZE / MASTER_ADDR set by hand (srun, mpirun, a job file): rank 0 names rank 1, which never
    starts; alone, rank 1 names rank 0's store it cannot reach."""
    timeout = 8
    runs, ports = {}, {rank: free_port() for rank in (0, 1)}       # each alone, in a world of its own
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[rank])}
        argv = BUNSAN + _train_args(corpus, tmp_path / f"out{rank}", tmp_path / f"cache{rank}", timeout)
        runs[rank] = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
    started = time.monotonic()
    try:
        logs = {rank: p.communicate(timeout=timeout + SLACK)[0] for rank, p in runs.items()}
    finally:
        for p in runs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert time.monotonic() - started < timeout + SLACK
    for rank, p in runs.items():
        assert p.returncode == 2 and "Traceback" not in logs[rank], logs[rank]
        assert len(_bunsan_lines(logs[rank])) == 1, logs[rank]
    zero, one = _bunsan_lines(logs[0])[0], _bunsan_lines(logs[1])[0]
    assert "rank(s) 1 (node(s) 1, counting from 0 at 1 rank(s) per node) did not join within 8s" in zero, zero
    assert "joined: ranks 0 on " in zero and "MASTER_ADDR" in zero, zero
    assert "rank 1 of 2 on " in one and f"could not reach rank 0's store at 127.0.0.1:{ports[1]}" in one, one
    assert "within 8s (train.timeout_s" in one and "GLOO_SOCKET_IFNAME" in one, one


def test_rank_0_that_cannot_host_the_store_says_whether_the_port_or_the_address_is_wrong(monkeypatch):
    from bunsan.comm.launched import join_store
    from bunsan.comm.work import CommError
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(CommError, match="another process holds the port; pick another MASTER_PORT"):
            join_store(0, 2, 3)
    monkeypatch.setenv("MASTER_ADDR", "nosuchhost.invalid")
    with pytest.raises(CommError, match=r"cannot reach it at nosuchhost\.invalid:\d+ .*MASTER_ADDR must name this "
                                        r"host"):
        join_store(0, 2, 3)


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_rank_that_stops_answering_is_named_and_every_node_ends_within_the_timeout(tmp_path, corpus, stopped):
    """SIGSTOP: a hung GPU rank, the commonest multi-node failure. Rank 0 hosts the store the roll call reads:
    stopped, the roll call must not wait on it."""
    timeout = 20
    with Cluster(tmp_path) as cluster:
        procs = _training(cluster, corpus, tmp_path / "out", timeout)
        os.kill(procs[stopped]["workers"][0], signal.SIGSTOP)
        stopped_at = time.monotonic()
        codes = cluster.wait_all(timeout + 2 * SLACK)
        took = time.monotonic() - stopped_at
        logs = [cluster.log(n) for n in range(2)]
    assert all(c != 0 for c in codes) and took < timeout + 2 * SLACK, (codes, took, logs)
    assert all("Traceback" not in log for log in logs), logs
    said = " ".join(_bunsan_lines(logs[1 - stopped]))
    # its peer names it (the roll call; rank 0 hosts the store, so stopped it cannot answer that either), its
    # own agent kills it once the peer has had its say
    assert f"rank {stopped} did not answer" in said if stopped else "rank 0 is stopped or hung" in said, logs
    assert f"rank {stopped} (pid" in logs[stopped] and "has been stopped (SIGSTOP" in logs[stopped], logs


def test_the_agent_kills_a_worker_stopped_past_the_timeout_and_only_that():
    from bunsan.cli.stopped_workers import StoppedWorkerWatch
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**os.environ, "RANK": "3"})
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        watch = StoppedWorkerWatch(10.0, "train.timeout_s")     # killed after 10 s + the roll call's 5 + 10
        watch.check(now=0.0)
        watch.check(now=20.0)
        assert stopped.poll() is None                           # peers still naming it
        watch.check(now=26.0)
        assert stopped.wait(5) == -signal.SIGKILL and running.poll() is None
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()
