"""What collectives.py counts: the traffic of each step (op, group, calls, logical bytes) and the time spent waiting.

Logical bytes are what a ring algorithm moves per rank, whatever the backend does underneath:

    all-reduce                      2 (N-1)/N * S
    reduce-scatter / all-gather       (N-1)/N * S     (S = the full, unsharded size)
    broadcast                                   S
    send / recv                                 S
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Per-(op, group) counters for the current step and since the start."""

    step: dict = field(default_factory=lambda: defaultdict(OpStats))
    total: dict = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, group_name: str, nbytes: int) -> None:
        key = (op, group_name)
        for table in (self.step, self.total):
            table[key].calls += 1
            table[key].bytes += int(nbytes)

    def new_step(self) -> None:
        self.step = defaultdict(OpStats)

    @staticmethod
    def _as_dict(table) -> dict:
        return {f"{op}/{g}": {"calls": s.calls, "bytes": s.bytes} for (op, g), s in sorted(table.items())}

    def summary(self) -> dict:
        return {"step": self._as_dict(self.step), "total": self._as_dict(self.total),
                "step_bytes": sum(s.bytes for s in self.step.values())}


def logical_bytes(op: str, nbytes: int, n: int) -> int:
    """Bytes a ring algorithm moves per rank for `op` over `n` ranks on a tensor of `nbytes`."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes // n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes // n
    return nbytes  # broadcast, send, recv; all_to_all_v: the caller counts the bytes it sends off-rank


MAX_PENDING = 1024       # device waits kept unread before the completed ones are added up


class WaitClock:
    """Seconds this rank spent blocked on communication (the doctor's slow-sync share).

    On gloo a wait blocks the process, so the host clock brackets it. On NCCL a wait blocks nothing on the
    host: it makes the compute stream wait for the communication stream, and a host clock would read about 0
    (or, after any sync, the compute queued before it). There two CUDA events recorded on the compute stream
    bracket the wait; they are read by `settle()` at the optimizer boundary, after the step's one host read,
    when they have completed, so reading them costs no extra sync."""

    def __init__(self):
        self.host_s = 0.0
        self.device_s = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self, on_device: bool):
        if on_device:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin
        return time.perf_counter()

    def stop(self, token) -> None:
        if isinstance(token, float):
            self.host_s += time.perf_counter() - token
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((token, end))
        if len(self._pending) > MAX_PENDING:   # no optimizer step settles them (serving, long evaluations)
            left = []
            for begin, end in self._pending:
                if end.query():
                    self.device_s += begin.elapsed_time(end) / 1e3
                else:
                    left.append((begin, end))
            self._pending = left

    def settle(self) -> None:
        """Add up the device waits recorded so far (waits for the last of them to complete)."""
        if self._pending:
            self._pending[-1][1].synchronize()
        for begin, end in self._pending:
            self.device_s += begin.elapsed_time(end) / 1e3
        self._pending.clear()

    @property
    def total_s(self) -> float:
        self.settle()
        return self.host_s + self.device_s
