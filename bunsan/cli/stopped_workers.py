"""The agent's watch over its workers: a worker stopped longer than the job's timeout is killed.

A stopped process (SIGSTOP, a debugger holding it, a job-control stop) keeps its sockets open and never
answers: its peers' collectives time out and they end, but torchrun's agent sees it alive and healthy and
waits on it for ever, and with it every node whose rendezvous it holds. Any other failure ends a worker by
itself (its collective timeout, NCCL's watchdog, the agent's death: comm/launched.py); a stop is the one it
cannot act on. So the agent's process runs this thread: every second it reads the state of its descendant
processes (Linux /proc), and one stopped for longer than its peers take to notice (the job's timeout, then
their roll call: comm/rollcall.py) is SIGKILLed with a line naming its rank, after which the agent reports it
failed and the job ends as for any failed worker.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from bunsan.comm.rollcall import roll_call_bound

POLL_S = 1.0
GRACE_S = 5.0       # past the peers' roll call, for their message to be written


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/pid/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            parents[int(name)] = st[1]
    out, frontier = [], {root}
    while frontier:
        kids = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out.extend(sorted(kids))
        frontier = kids
    return out


def _rank_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return f"rank {env[b'RANK'].decode()}" if b"RANK" in env else f"pid {pid}"
    except (OSError, KeyError, ValueError):
        return f"pid {pid}"


class StoppedWorkerWatch:
    def __init__(self, timeout_s: float, source: str, root: int | None = None):
        # the peers' collective times out, their roll call names the stopped rank: then kill it
        self.timeout_s = timeout_s + roll_call_bound(timeout_s) + GRACE_S
        self.source = f"{source} {timeout_s:g}s, and the peers' roll call"
        self.root = root if root is not None else os.getpid()
        self.since: dict[int, float] = {}
        self.killed: list[int] = []

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        stopped = set()
        for pid in descendants(self.root):
            st = _stat(pid)
            if st is None or st[0] not in ("T", "t"):
                continue
            stopped.add(pid)
            start = self.since.setdefault(pid, now)
            if now - start > self.timeout_s and pid not in self.killed:
                print(f"bunsan run: {_rank_of(pid)} (pid {pid}) on {socket.gethostname()} has been stopped "
                      f"(SIGSTOP, or held by a debugger) for more than {self.timeout_s:g}s ({self.source}); "
                      "killing it so that the job ends (its peers time out on it and stop too)",
                      file=sys.stderr, flush=True)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
                self.killed.append(pid)
        self.since = {p: t for p, t in self.since.items() if p in stopped}

    def start(self) -> StoppedWorkerWatch:
        if sys.platform.startswith("linux"):
            threading.Thread(target=self._run, name="bunsan-stopped-workers", daemon=True).start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            try:
                self.check()
            except Exception:    # noqa: BLE001  (a watch that fails must not take the agent with it)
                pass
