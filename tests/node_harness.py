"""Machines simulated on one, for the multi-node tests: each "node" is a `bunsan run` agent in its own PID,
mount and UTS namespaces (its own hostname, resolving to its own loopback address through its own
/etc/hosts, and a private tmpfs where its caches live), meeting over loopback through c10d. The network
namespace is shared: a node's address is 127.0.0.(2 + n), its name node<n>.

PID 1 of each node is tests/node_init.py: it outlives the agent, so a worker orphaned by a killed agent
keeps running as it would on a real machine. The test sees every process from outside (host pids, through
/proc: each carries the node's mark in its environment), kills whichever it likes, and `close()` kills
each node whole (SIGKILL to `unshare --kill-child` takes PID 1 of the namespace, and the kernel the rest).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

BUNSAN = [sys.executable, "-m", "bunsan.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo"}
NODE_INIT = Path(__file__).with_name("node_init.py")
MARK = "BUNSAN_TEST_NODE"


def namespaces_work() -> str | None:
    probe = subprocess.run(["unshare", "--pid", "--mount", "--uts", "--fork", "true"], capture_output=True)
    return None if probe.returncode == 0 else (probe.stderr.decode()[:200] or "unshare failed")


def need_namespaces() -> None:
    why = namespaces_work()
    if why:
        pytest.skip(f"no PID/mount/UTS namespaces here (they need root): {why}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _proc(pid: str):
    """(ppid, argv, environ mark) of a host process, or None if it is gone or unreadable."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":                         # a zombie has ended
        return None
    mark = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(MARK.encode() + b"=")), None)
    return int(fields[1]), argv, mark


class Cluster:
    """Up to `nodes` simulated machines under `root` (shared by all: the "network filesystem")."""

    def __init__(self, root: Path, nodes: int = 2):
        need_namespaces()
        self.root, self.nodes = root, nodes
        self.local = root / "node-local"         # each node mounts its own tmpfs here
        self.local.mkdir(exist_ok=True)
        # each node's name resolves to its own loopback address (mounted over /etc/hosts): one address for
        # all would make them one node to the rendezvous (same name, and the same pid in their namespaces)
        self.hosts = root / "hosts"
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.{2 + n} node{n}\n" for n in range(nodes)))
        self.port = free_port()
        self.tag = uuid.uuid4().hex[:12]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def endpoint(self) -> str:
        return f"node0:{self.port}"

    def run_args(self, nproc: int = 1, restarts: int = 0) -> list[str]:
        """`bunsan run`'s flags for this cluster (the rendezvous timeouts left to bunsan: train.timeout_s)."""
        return ["run", "--nnodes", str(self.nodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", self.endpoint, "--max-restarts", str(restarts)]

    def start(self, node: int, argv: list[str], wait_for_store: bool = True) -> None:
        """Start `argv` (a command, e.g. BUNSAN + run_args + ...) as node `node`. Node 0 first: the others wait
        until it hosts the rendezvous store, so that node 0 is the store's host (whoever binds first is)."""
        script = (f"hostname node{node} && mount --bind {self.hosts} /etc/hosts && "
                  f"mount -t tmpfs tmpfs {self.local} && exec {sys.executable} {NODE_INIT} {shlex.join(argv)}")
        with open(self.log_path(node), "w") as log:
            self.procs[node] = subprocess.Popen(
                ["unshare", "--pid", "--mount", "--uts", "--kill-child", "--mount-proc", "sh", "-c", script],
                stdout=log, stderr=subprocess.STDOUT, env={**ENV, MARK: f"{self.tag}-{node}"}, cwd=self.root,
                start_new_session=True)
        if node == 0 and wait_for_store:
            self.wait_until(lambda: _listening(self.port), 120, "node 0 hosting the rendezvous store")

    def log_path(self, node: int) -> Path:
        return self.root / f"node{node}.log"

    def log(self, node: int) -> str:
        return self.log_path(node).read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"----- node{n} -----\n{self.log(n)}" for n in sorted(self.procs))

    def wait(self, node: int, timeout: float) -> int:
        """Node `node`'s exit code (its command's); a node still running after `timeout` fails the test."""
        try:
            return self.procs[node].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node{node} still running after {timeout:g}s:\n{self.logs()}")

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [self.wait(n, max(1.0, deadline - time.monotonic())) for n in sorted(self.procs)]

    def processes(self, node: int) -> dict[str, list[int]]:
        """Host pids of node `node`'s processes: its init, its agent (the init's child) and the agent's children
        (the workers)."""
        mine = {}
        for pid in os.listdir("/proc"):
            if pid.isdigit() and (p := _proc(pid)) is not None and p[2] == f"{self.tag}-{node}":
                mine[int(pid)] = p
        init = [pid for pid, (_, argv, _) in mine.items() if len(argv) > 1 and argv[1] == str(NODE_INIT)]
        agent = [pid for pid, (ppid, _, _) in mine.items() if ppid in init]
        workers = [pid for pid, (ppid, _, _) in mine.items() if ppid in agent]
        return {"init": init, "agent": agent, "workers": workers}

    def wait_until(self, ready, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (got := ready()):
                return got
            if any(p.poll() is not None for p in self.procs.values()):
                pytest.fail(f"a node ended while waiting for {what}:\n{self.logs()}")
            time.sleep(0.1)
        pytest.fail(f"no {what} within {timeout:g}s:\n{self.logs()}")

    def kill_node(self, node: int) -> None:
        """The whole machine at once (its PID 1, so the kernel kills the rest of the namespace)."""
        self.procs[node].kill()
        self.procs[node].wait(30)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(30)
        deadline = time.monotonic() + 60     # (the kernel reaps a dying namespace's processes in its own time)
        while True:
            left = [pid for n in self.procs for pids in self.processes(n).values() for pid in pids]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in left:             # (none should be: the namespaces died with their PID 1)
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes outlived their node: {left}"

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def gone(pids: list[int]) -> bool:
    return all(_proc(str(pid)) is None for pid in pids)
