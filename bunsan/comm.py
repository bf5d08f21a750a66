"""The only door to the other ranks.

Every collective and point-to-point call in bunsan goes through this module so
that (1) each one runs with a timeout and fails with a message that names the
rank, the op and the group, and (2) the traffic is accounted per step: op,
group, calls and *logical* bytes, i.e. what a ring algorithm moves per rank:

    all-reduce                      2 (N-1)/N * S
    reduce-scatter / all-gather       (N-1)/N * S     (S = the full, unsharded size)
    broadcast                                   S
    send / recv                                 S

Logical bytes, not timings: what the algorithm is asked to move, whatever the
backend does underneath. On gloo (`train.gloo_collectives`):

    shm       (default) all-reduce, reduce-scatter and all-gather through shared
              memory when the group's ranks share a host (shm.py: 3-10x faster than
              gloo's loopback TCP), and the pipeline's messages through a mailbox
              (shm_mailbox.py: mailbox, post, fetch); otherwise as `exchange`
    exchange  all-gather and reduce-scatter as direct exchanges of point-to-point
              messages (exchange.py: gloo's own are 3x slower); all-reduce gloo's
    native    torch's own collectives
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import exchange, shm, shm_mailbox


# torch 2.13 renamed the tensor forms; keep working on torch>=2.6.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class CommError(RuntimeError):
    """A collective failed or timed out; the message names rank, op and group."""


@dataclass
class Group:
    """A process group with a name (for accounting) and its size and our rank in it."""

    name: str
    pg: object | None  # torch ProcessGroup; None for a group of one (no communication)
    size: int
    rank: int
    ranks: tuple[int, ...] = ()


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommStats:
    """Per-(op, group) counters for the current step and since the start."""

    step: dict = field(default_factory=lambda: defaultdict(OpStats))
    total: dict = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, group: Group, nbytes: int) -> None:
        key = (op, group.name)
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
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * nbytes // n
    return nbytes  # broadcast, send, recv


class _Handle:
    """Wraps an async work object so that waiting has a timeout and a clear error."""

    def __init__(self, comm: "Comm", work, op: str, group: Group):
        self._comm, self._work, self._op, self._group = comm, work, op, group

    def wait(self) -> None:
        if self._work is None:
            return
        start = time.perf_counter()
        try:
            ok = self._work.wait(datetime.timedelta(seconds=self._comm.timeout_s))
        except RuntimeError as e:  # gloo raises on timeout or a dead peer
            raise self._comm.error(self._op, self._group, e) from e
        finally:
            self._comm.wait_s += time.perf_counter() - start
        if ok is False:
            raise self._comm.error(self._op, self._group, "timed out")
        self._work = None

    def done(self) -> bool:
        """Completed (or failed: wait() then raises), without blocking."""
        return self._work is None or self._work.is_completed()


class Comm:
    """Collectives with accounting and timeouts. One per engine (groups are passed, not global)."""

    def __init__(self, timeout_s: float = 120.0, gloo_collectives: str = "shm"):
        if gloo_collectives not in ("shm", "exchange", "native"):
            raise ValueError(f"gloo_collectives={gloo_collectives!r}: expected 'shm', 'exchange' or 'native'")
        self.timeout_s = float(timeout_s)
        self.stats = CommStats()
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self._exchange_on_gloo = gloo_collectives != "native"
        self._shm_on_gloo = gloo_collectives == "shm"
        # ranks -> their shared-memory ring, if any: groups of the same ranks (world and dp without TP or PP)
        # share one, as they share the order of their collectives
        self._rings: dict[tuple[int, ...], shm.ShmRing | None] = {}
        self._exchanges: dict[str, bool] = {}   # group name -> run all-gather / reduce-scatter as exchanges
        self._tags = exchange.TagSequence()
        self._seq: dict[str, int] = defaultdict(int)   # collectives issued per group (the roll call names them)
        self.wait_s = 0.0            # seconds blocked waiting for communication (the doctor's slow-sync check)
        self.finished_step = 0

    def _exchange_tag(self, group: Group) -> int | None:
        """The tag of the next exchange on `group`, or None where the backend's own collective runs."""
        use = self._exchanges.get(group.name)
        if use is None:
            use = self._exchanges[group.name] = (self._exchange_on_gloo
                                                 and dist.get_backend(group.pg) == dist.Backend.GLOO)
        return self._tags.next(group.name) if use else None

    def _ring(self, group: Group, t: torch.Tensor) -> shm.ShmRing | None:
        """The group's shared-memory ring for a CPU tensor, set up (collectively, inside _run: a rank that never
        comes is a CommError after the timeout) at the group's first collective."""
        ring = self._rings.get(group.ranks, False)
        if ring is False:
            ring = None
            if self._shm_on_gloo and dist.get_backend(group.pg) == dist.Backend.GLOO:
                ring = shm.ShmRing.open(group.pg, group.rank, group.ranks, self.timeout_s)
            self._rings[group.ranks] = ring
        return ring if ring is not None and t.device.type == "cpu" else None

    def transport(self, group: Group) -> str:
        """What carries the group's CPU collectives (after its first one): 'shm', 'exchange' (all-gather and
        reduce-scatter; all-reduce is gloo's) or 'native'."""
        if self._rings.get(group.ranks):
            return "shm"
        gloo = group.pg is not None and dist.get_backend(group.pg) == dist.Backend.GLOO
        return "exchange" if self._exchange_on_gloo and gloo else "native"

    def error(self, op: str, group: Group, cause) -> CommError:
        from .doctor.rollcall import roll_call
        seq = self._seq[group.name]
        text = str(cause).lower()
        # a roll call only where another rank may be to blame (a timeout, a lost peer), not a local mistake
        peer = any(w in text for w in ("timed out", "timeout", "connection", "closed", "reset", "peer", "broken"))
        who = roll_call(self.global_rank, op, group, seq, window_s=max(2.0, min(10.0, self.timeout_s / 2))) \
            if peer else ""
        return CommError(
            f"rank {self.global_rank}: {op} #{seq} on group '{group.name}' (ranks {list(group.ranks)}) failed: "
            f"{cause}. Another rank probably died, hung or skipped this {op}; the collective timeout is "
            f"{self.timeout_s:g}s (train.timeout_s); this rank last finished step {self.finished_step}.{who}"
        )

    def _run(self, op: str, group: Group, nbytes, fn, async_op: bool):
        """Run `fn` (-> a work object, or None when it finished the op) as `op`; `nbytes` may be a function,
        called after `fn` (a receive learns its size from the message)."""
        if op not in ("send", "recv"):     # point-to-point calls differ per rank: only collectives line up
            self._seq[group.name] += 1
        start = time.perf_counter()
        try:
            work = fn()           # (an exchange on gloo may block here: count it as waiting)
        except RuntimeError as e:
            raise self.error(op, group, e) from e
        finally:
            self.wait_s += time.perf_counter() - start
        self.stats.record(op, group, logical_bytes(op, nbytes() if callable(nbytes) else nbytes, group.size))
        handle = _Handle(self, work, op, group)
        if async_op:
            return handle
        handle.wait()
        return None

    def _collective(self, op: str, group: Group, t: torch.Tensor, nbytes: int, on_ring, on_exchange, native,
                    async_op: bool):
        """Run `op` on the group's transport: its shared-memory ring (on_ring(ring)), else a point-to-point
        exchange (on_exchange(tag); None where the op has none), else the backend's own (native())."""
        def fn():
            ring = self._ring(group, t)
            if ring is not None:
                return on_ring(ring)
            tag = self._exchange_tag(group) if on_exchange is not None else None
            return native() if tag is None else on_exchange(tag)
        return self._run(op, group, nbytes, fn, async_op)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: Group, async_op: bool = False, op: str = "sum"):
        """In-place SUM (or MAX) all-reduce (gloo has no AVG: callers divide themselves)."""
        if group.size == 1:
            return _Handle(self, None, "all_reduce", group) if async_op else None
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        return self._collective("all_reduce", group, t, t.numel() * t.element_size(),
                                lambda ring: ring.all_reduce(t, op), None,
                                lambda: dist.all_reduce(t, op=red, group=group.pg, async_op=True), async_op)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False):
        """Gather equal shards into `out` (size N x shard)."""
        if group.size == 1:
            out.copy_(shard.view_as(out))
            return _Handle(self, None, "all_gather", group) if async_op else None

        def native():
            src = shard
            if out.device.type == "cpu" and _aliases(shard, out):   # NCCL gathers in place; gloo's copy may not
                src = shard.clone()
            return _all_gather(out, src, group=group.pg, async_op=True)
        return self._collective("all_gather", group, out, out.numel() * out.element_size(),
                                lambda ring: ring.all_gather(out, shard),
                                lambda tag: exchange.all_gather(out, shard, group.ranks, group.rank, group.pg, tag),
                                native, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = False):
        """SUM-reduce `full` across ranks and keep this rank's 1/N shard in `out`."""
        if group.size == 1:
            out.copy_(full.view_as(out))
            return _Handle(self, None, "reduce_scatter", group) if async_op else None
        return self._collective(
            "reduce_scatter", group, full, full.numel() * full.element_size(),
            lambda ring: ring.reduce_scatter(out, full),
            lambda tag: exchange.reduce_scatter(out, full, group.ranks, group.rank, group.pg, tag),
            lambda: _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group.pg, async_op=True), async_op)

    def broadcast(self, t: torch.Tensor, src_rank: int, group: Group, async_op: bool = False):
        """Broadcast from group-local rank `src_rank`."""
        if group.size == 1:
            return _Handle(self, None, "broadcast", group) if async_op else None
        src = group.ranks[src_rank]
        return self._run("broadcast", group, t.numel() * t.element_size(),
                         lambda: dist.broadcast(t, src=src, group=group.pg, async_op=True), async_op)

    def all_reduce_scalars(self, values: list[float], group: Group) -> list[float]:
        """SUM a few float64 scalars across the group (token counts, losses)."""
        t = torch.tensor(values, dtype=torch.float64)
        self.all_reduce(t, group)
        return t.tolist()

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        self.all_reduce(torch.zeros(1), group)

    # -- point to point ------------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, group: Group, tag: int = 0):
        """Non-blocking send to global rank `dst` of `group`; wait() on the handle before reusing `t`."""
        return self._run("send", group, t.numel() * t.element_size(),
                         lambda: dist.isend(t, dst=dst, group=group.pg, tag=tag), True)

    def irecv(self, t: torch.Tensor, src: int, group: Group, tag: int = 0):
        return self._run("recv", group, t.numel() * t.element_size(),
                         lambda: dist.irecv(t, src=src, group=group.pg, tag=tag), True)

    # -- point to point through shared memory (shm_mailbox.py) ----------------------------------
    def mailbox(self, group: Group) -> shm_mailbox.Mailbox | None:
        """Collective over `group`: shared-memory channels between its neighbouring ranks, where
        train.gloo_collectives is shm, the group is on gloo and its ranks share a host; else None (every rank)."""
        if not self._shm_on_gloo or group.size == 1 or dist.get_backend(group.pg) != dist.Backend.GLOO:
            return None
        try:
            return shm_mailbox.Mailbox.open(group.pg, group.rank, group.ranks, self.timeout_s)
        except RuntimeError as e:
            raise self.error("mailbox set-up", group, e) from e

    def post(self, box: shm_mailbox.Mailbox, t: torch.Tensor, dst: int, group: Group, tag: int):
        """Send contiguous CPU `t` to group rank `dst` through the mailbox; a handle to wait on before reusing
        `t` (a message no slot holds goes through gloo under tag + 1)."""
        def fn():
            if box.send(t, dst, tag):
                return None
            return dist.isend(t, dst=group.ranks[dst], group=group.pg, tag=tag + 1)
        return self._run("send", group, t.numel() * t.element_size(), fn, True)

    def fetch(self, box: shm_mailbox.Mailbox, src: int, group: Group, tag: int) -> torch.Tensor:
        """Receive what group rank `src` posted under `tag` (blocking)."""
        got: list[torch.Tensor] = []

        def fn():
            t, in_memory = box.recv(src, tag)
            got.append(t)
            return None if in_memory else dist.irecv(t, src=group.ranks[src], group=group.pg, tag=tag + 1)
        self._run("recv", group, lambda: got[0].numel() * got[0].element_size(), fn, False)
        return got[0]


def all_reduce_on(comm, group, device: torch.device):
    """SUM over `group` of a tensor wherever it lives, through `device` (NCCL reduces device tensors only; an
    offloaded optimizer keeps its statistics on the host)."""
    def reduce(t: torch.Tensor) -> None:
        if t.device == device:
            comm.all_reduce(t, group)
            return
        on = t.to(device)
        comm.all_reduce(on, group)
        t.copy_(on)
    return reduce
