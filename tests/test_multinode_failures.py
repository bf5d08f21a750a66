"""What the surviving side of a multi-node job sees when part of it is gone: a node's agent SIGKILLed alone (its
worker must end with it, the other node must not wait out torch's 300 s exit barrier), the node hosting the
stores killed whole, a node that never starts (from `bunsan run`, and from `bunsan train` launched by a
scheduler that sets RANK / WORLD_SIZE itself), a rank that stops answering. Each ends with a bunsan message
naming what is missing, and no Python traceback.

No clock is read in an assertion: each case asserts the cause its messages name. A lost process is noticed
from its closed connection, so those runs get a timeout (train.timeout_s, --timeout) no test reaches (NEVER_S):
a message saying "timed out", or a run still going at the ceiling, would mean the loss went unnoticed. A
node that never comes and a stopped rank are noticed only by a timeout: there it is short (the behaviour is
the same at a few seconds as at 20), and every other wait it would bound is taken out of the race: the
rendezvous gets its own bounds (--rdzv-conf), the token cache is built beforehand, so what is left is the
workers joining, which differ by their start-ups only (they start together). Ceilings (CEILING_S) only catch
hangs.

The simulated nodes are tests/node_harness.py's (PID, mount and UTS namespaces: skipped where not allowed);
`bunsan train` under a scheduler, and a worker ending with its agent on one machine, need none.

    case                                       timeout   what ends it
    an agent killed alone (node1)              NEVER_S   the worker's parent-death signal; node0's collective
                                                         fails on the closed connection, its roll call names
                                                         rank 1
    the store host (node0) killed whole        NEVER_S   node1's worker or agent sees the store's connection
                                                         closed
    a node that never starts                   3 s       the rendezvous' join_timeout, from --timeout
    a rank that never comes, under a scheduler 5 s       rank 0's roll call at joining; rank 1's connect
    rank 0 / rank 1 stopped (SIGSTOP)          10 s      the peer's collective timeout and roll call (rank 0
                                                         hosts the store it reads), then the stopped rank's
                                                         agent kills it (timeout + roll call bound + grace)
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node_harness import BUNSAN, ENV, Cluster, free_port, gone

NEVER_S = 600       # a timeout no test reaches: CEILING_S fails a run long before
CEILING_S = 180     # a start, or a fault to every node's end: only a hang reaches it (torch's exit barrier too: 300 s)
STOPPED_TIMEOUT_S = 10   # what a stopped rank is found by; the workers' start-ups may differ by less


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus, with its token cache built here: each node would build its own at start-up, bounded by the
    job's timeout, and what these tests provoke comes later (the caches are tests/test_multinode_harness.py's)."""
    import argparse
    import inspect
    from bunsan.training.data import TokenCache
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (json, argparse)))
    TokenCache([d / "code.py"], cache_dir=d / "cache").build()
    return d


def _train_args(corpus, out, timeout, steps=3):
    return ["train", "--preset", "tiny", "--steps", str(steps), "--micro-batch", "2", "--seq-len", "64",
            "--data", str(corpus / "*.py"), "--output", str(out), "--set", f"data.cache_dir={corpus / 'cache'}",
            "--set", "data.val_fraction=0", "--set", "steps_per_print=1", "--timeout", str(timeout)]


def _bunsan_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("bunsan ")]


# The rendezvous' own waits, which bunsan run otherwise takes from --timeout: node1's agent joins a whole
# start-up after node0's, so a short --timeout there would race a loaded machine's start-up
SETUP = ["--rdzv-conf", f"join_timeout={NEVER_S},read_timeout={NEVER_S}"]


def _training(cluster, corpus, out, timeout):
    """Both nodes training a run far longer than the test (it never ends by itself), once both are past step 1."""
    argv = BUNSAN + cluster.run_args() + SETUP + ["-m", "bunsan.cli"] + \
        _train_args(corpus, out, timeout, steps=1_000_000)
    for node in range(2):
        cluster.start(node, argv)
    metrics = out / "metrics.jsonl"
    cluster.wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, CEILING_S,
                       "training under way on both nodes")
    procs = [cluster.processes(n) for n in range(2)]
    assert all(len(p["agent"]) == 1 and len(p["workers"]) == 1 for p in procs), procs
    return procs


def _lost_connection(line: str) -> bool:
    """The line says its peer's connection closed (gloo's or the store's), not that a wait timed out."""
    return bool(re.search(r"Connection (reset|closed|refused|was likely closed)|Broken pipe", line)) and \
        "timed out" not in line.lower()


@pytest.mark.e2e
def test_an_agent_killed_alone_takes_its_worker_and_the_other_node_ends_on_the_lost_connection(tmp_path, corpus):
    with Cluster(tmp_path) as cluster:
        _, node1 = _training(cluster, corpus, tmp_path / "out", NEVER_S)
        os.kill(node1["agent"][0], signal.SIGKILL)
        # PR_SET_PDEATHSIG (comm/launched.py): without it the worker trains on, an orphan, for ever
        cluster.wait_until(lambda: gone(node1["workers"]), CEILING_S, "node1's worker ending with its agent")
        code = cluster.wait(0, CEILING_S)
        log = cluster.log(0)
    assert code != 0, log
    assert "Traceback" not in log, log
    lines = _bunsan_lines(log)
    # node0's worker names its lost peer (the roll call), its agent the failed process: nothing else
    named = [line for line in lines if "rank 0" in line and "rank 1 did not answer" in line]
    assert named and _lost_connection(named[0]), log
    assert lines[-1].startswith("bunsan run: 1 process(es) on node0 failed: rank 0 (exit 2)"), log


SLEEPER = """
import os, sys, time
from pathlib import Path
import bunsan
bunsan.init_distributed()          # under torchrun: where a worker binds itself to its agent
Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.e2e
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
        deadline = time.monotonic() + CEILING_S
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert agent.poll() is None, agent.communicate()[0]
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        agent.kill()
        agent.wait(30)
        deadline = time.monotonic() + CEILING_S
        while not gone([worker]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone([worker]), "the worker outlived its SIGKILLed agent"
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        if worker is not None and not gone([worker]):
            os.kill(worker, signal.SIGKILL)


def _bonded(agent_mark: str) -> tuple[int, str]:
    """A child made as a launched worker (TORCHELASTIC_RUN_ID, BUNSAN_AGENT_PID) binding itself to its agent: its
    wait status and what it wrote to stderr. Forked: the check needs a process of its own, not an interpreter."""
    from bunsan.comm.launched import die_with_agent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read)
            sys.stderr = open(write, "w", buffering=1, closefd=False)      # (not pytest's capture)
            os.environ.update(TORCHELASTIC_RUN_ID="test", BUNSAN_AGENT_PID=agent_mark)
            die_with_agent()
            print("survived", file=sys.stderr)
        except BaseException:       # noqa: BLE001  (said in the pipe, never past this child)
            import traceback
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    return os.waitpid(pid, 0)[1], said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_worker_whose_agent_died_before_the_bond_ends_at_once():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = os.readlink("/proc/self/ns/pid")
    status, said = _bonded(f"{dead.pid}@{here}")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL and "survived" not in said, said
    assert f"the agent (pid {dead.pid}) that started this rank is gone" in said, said
    # an agent's pid from another PID namespace (a container wrapper between agent and worker) says nothing
    # about this one: no check, the worker lives
    status, said = _bonded(f"{dead.pid}@pid:[1]")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and "survived" in said, said


@pytest.mark.e2e
def test_the_node_hosting_the_stores_killed_is_named_by_the_other_from_the_lost_connection(tmp_path, corpus):
    with Cluster(tmp_path) as cluster:
        _training(cluster, corpus, tmp_path / "out", NEVER_S)
        cluster.kill_node(0)          # its agent hosts the rendezvous store, its worker rank 0's store
        code = cluster.wait(1, CEILING_S)
        log = cluster.log(1)
    assert code != 0, log
    assert "Traceback" not in log, log
    # whichever notices first, node1's worker (its collective fails, then its roll call finds the store gone)
    # or its agent (the rendezvous store is gone), the message names the store on rank 0's node, and the
    # closed connection that told it
    said = [line for line in _bunsan_lines(log) if ("store on rank 0's node" in line and "died or was killed" in line)
            or (f"rendezvous store at {cluster.endpoint}" in line and "the node of rank 0" in line)]
    assert said and all(_lost_connection(line) for line in said), log


@pytest.mark.e2e
def test_a_node_that_never_starts_is_named_after_the_timeout(tmp_path, corpus):
    """Only node0 of --nnodes 2 starts; bunsan run's rendezvous join timeout comes from the job's --timeout (short:
    nothing else is waited for, the other node never comes)."""
    timeout = 3
    with Cluster(tmp_path) as cluster:
        # (its store reads get their own bound: only the join, the case's subject, takes --timeout)
        cluster.start(0, BUNSAN + cluster.run_args() + ["--rdzv-conf", f"read_timeout={NEVER_S}", "-m", "bunsan.cli"]
                      + _train_args(corpus, tmp_path / "out", timeout))
        code = cluster.wait(0, CEILING_S)
        log = cluster.log(0)
    assert code == 1 and "Traceback" not in log, log
    assert _bunsan_lines(log) == [line for line in log.splitlines() if "did not all join" in line], log
    line = _bunsan_lines(log)[0]
    assert f"the 2 node(s) of --nnodes did not all join the rendezvous at {cluster.endpoint} within {timeout} s " \
           "(join_timeout, train.timeout_s)" in line and "this node (node0) did" in line, line
    assert "GLOO_SOCKET_IFNAME" in line and "resolves on every node" in line, line


@pytest.mark.e2e
def test_bunsan_train_under_a_scheduler_names_the_rank_that_never_came(tmp_path, corpus):
    """RANK / WORLD_SIZE / MASTER_ADDR set by hand (srun, mpirun, a job file): rank 0 names rank 1, which never
    starts; alone, rank 1 names rank 0's store it cannot reach. Short timeouts: each waits only for a rank that
    never comes."""
    timeout = 5
    runs, ports = {}, {rank: free_port() for rank in (0, 1)}       # each alone, in a world of its own
    for rank in (0, 1):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[rank])}
        argv = BUNSAN + _train_args(corpus, tmp_path / f"out{rank}", timeout)
        runs[rank] = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True)
    try:
        logs = {rank: p.communicate(timeout=CEILING_S)[0] for rank, p in runs.items()}
    finally:
        for p in runs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for rank, p in runs.items():
        assert p.returncode == 2 and "Traceback" not in logs[rank], logs[rank]
        assert len(_bunsan_lines(logs[rank])) == 1, logs[rank]
    zero, one = _bunsan_lines(logs[0])[0], _bunsan_lines(logs[1])[0]
    assert f"rank(s) 1 (node(s) 1, counting from 0 at 1 rank(s) per node) did not join within {timeout}s" in zero, zero
    assert "joined: ranks 0 on " in zero and "MASTER_ADDR" in zero, zero
    assert "rank 1 of 2 on " in one and f"could not reach rank 0's store at 127.0.0.1:{ports[1]}" in one, one
    assert f"within {timeout}s (train.timeout_s" in one and "GLOO_SOCKET_IFNAME" in one, one


def test_rank_0_that_cannot_host_the_store_says_whether_the_port_or_the_address_is_wrong(monkeypatch):
    from bunsan.comm.launched import join_store
    from bunsan.comm.work import CommError
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(CommError, match="another process holds the port; pick another MASTER_PORT"):
            join_store(0, 2, 1)
    monkeypatch.setenv("MASTER_ADDR", "nosuchhost.invalid")     # (torch's connect retries until the timeout)
    with pytest.raises(CommError, match=r"cannot reach it at nosuchhost\.invalid:\d+ .*MASTER_ADDR must name this "
                                        r"host"):
        join_store(0, 2, 1)


@pytest.mark.e2e
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_rank_that_stops_answering_is_named_and_every_node_ends(tmp_path, corpus, stopped):
    """SIGSTOP: a hung GPU rank, the commonest multi-node failure. Rank 0 hosts the store the roll call reads:
    stopped, the roll call must not wait on it."""
    with Cluster(tmp_path) as cluster:
        procs = _training(cluster, corpus, tmp_path / "out", STOPPED_TIMEOUT_S)
        os.kill(procs[stopped]["workers"][0], signal.SIGSTOP)
        codes = cluster.wait_all(CEILING_S)
        logs = [cluster.log(n) for n in range(2)]
    assert all(c != 0 for c in codes), (codes, logs)
    assert all("Traceback" not in log for log in logs), logs
    said = " ".join(_bunsan_lines(logs[1 - stopped]))
    # its peer names it (the roll call; rank 0 hosts the store, so stopped it cannot answer that either), its
    # own agent kills it once the peer has had its say
    assert f"rank {stopped} did not answer" in said if stopped else "rank 0 is stopped or hung" in said, logs
    assert f"rank {stopped} (pid" in logs[stopped] and "has been stopped (SIGSTOP" in logs[stopped], logs
    # the bound it was killed past: the timeout, the peers' roll call and its grace (every node ends within it)
    from bunsan.cli.stopped_workers import GRACE_S
    from bunsan.comm.rollcall import roll_call_bound
    bound = STOPPED_TIMEOUT_S + roll_call_bound(STOPPED_TIMEOUT_S) + GRACE_S
    assert f"for more than {bound:g}s (train.timeout_s {STOPPED_TIMEOUT_S:g}s, and the peers' roll call)" \
        in logs[stopped], logs


def test_the_agent_kills_a_worker_stopped_past_the_timeout_and_only_that():
    from bunsan.cli.stopped_workers import StoppedWorkerWatch
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**os.environ, "RANK": "3"})
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + CEILING_S          # (the stop takes effect when the child next runs)
        while Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.05)
        watch = StoppedWorkerWatch(10.0, "train.timeout_s")     # killed after 10 s + the roll call's 5 + 10
        watch.check(now=0.0)
        watch.check(now=20.0)
        assert stopped.poll() is None                           # peers still naming it
        watch.check(now=26.0)
        assert stopped.wait(CEILING_S) == -signal.SIGKILL and running.poll() is None
    finally:
        for p in (stopped, running):
            p.kill()
            p.wait()
