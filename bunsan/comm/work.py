"""What collectives.py takes and hands out: named groups, the sends and receives of a batch, handles to wait on, and
its two errors (a failed or timed-out collective; a tensor on the wrong device, the caller's bug)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch


class CommError(RuntimeError):
    """A collective failed or timed out; the message names rank, op and group."""


class DeviceError(ValueError):
    """A tensor handed to a collective is not on this rank's device: the caller's bug."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """An error's first line: torch's store and gloo errors carry a C++ backtrace after it."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


@dataclass
class Group:
    """A process group with a name (for accounting) and its size and our rank in it."""

    name: str
    pg: object | None  # torch ProcessGroup; None for a group of one (no communication)
    size: int
    rank: int
    ranks: tuple[int, ...] = ()


@dataclass
class P2POp:
    """One send or receive of a batch (Comm.batch_p2p): `peer` is a global rank."""

    kind: str          # "send" | "recv"
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class Handle:
    """An async work object (or several: a batch, an exchange); wait() once, then `after` (a staged copy back)."""

    def __init__(self, comm, works, op: str, group: Group, on_device: bool = False, after=None):
        self._comm, self._op, self._group, self._on_device, self._after = comm, op, group, on_device, after
        self._works = [w for w in (works if isinstance(works, list) else [works]) if w is not None]

    def wait(self) -> None:
        if self._works:
            clock = self._comm.clock
            token = clock.start(self._on_device)
            try:
                for w in self._works:
                    if self._on_device:
                        w.wait()   # orders the streams; the host goes on (the process group's watchdog times out)
                    elif w.wait(datetime.timedelta(seconds=self._comm.timeout_s)) is False:
                        raise self._comm.error(self._op, self._group, "timed out")
            except RuntimeError as e:  # gloo raises on timeout or a dead peer
                if isinstance(e, CommError):
                    raise
                raise self._comm.error(self._op, self._group, e) from e
            finally:
                clock.stop(token)
            self._works = []
        if self._after is not None:
            after, self._after = self._after, None
            after()

    def done(self) -> bool:
        """Completed (or failed: wait() then raises), without blocking."""
        return all(getattr(w, "is_completed", lambda: False)() for w in self._works)
