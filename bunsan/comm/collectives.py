"""The only door to the other ranks.

Every collective and point-to-point call in bunsan goes through this module, so that:

1. every tensor handed to it is on this rank's device (`Comm.device`), checked at each call: NCCL takes device
   tensors only, and a host tensor that reaches it is the caller's bug, reported as such (DeviceError), never
   as a lost peer;
2. waits are right for the backend: on gloo they block the host with a timeout and fail with a message that
   names the rank, the op and the group; on NCCL they only order the streams (no host sync), and the process
   group's timeout and watchdog catch a hang;
3. the traffic is accounted per step: op, group, calls and logical bytes (comm/stats.py).

On gloo (`train.gloo_collectives`), collectives between host tensors go through:

    shm       (default) all-reduce, reduce-scatter and all-gather through shared memory when the group's ranks
              share a host (shm.py: no loopback TCP), and the pipeline's messages through a
              mailbox (comm/mailbox.py: mailbox, post, fetch); otherwise as `exchange`
    exchange  all-gather and reduce-scatter as direct exchanges of point-to-point messages (exchange.py: what a
              ring moves, every transfer in flight at once); all-reduce gloo's
    native    torch's own collectives

gloo on a GPU rank (several ranks sharing one GPU, `train.backend: gloo`) moves device tensors through host
copies here, inside the collective, so the step itself stays on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from bunsan.comm import exchange, shm, mailbox as shm_mailbox
from bunsan.comm.stats import CommStats, WaitClock, logical_bytes
from bunsan.comm.work import CommError, DeviceError, Group, P2POp, Handle

__all__ = ["Comm", "CommError", "DeviceError", "Group", "P2POp", "all_reduce_on", "logical_bytes"]

# torch 2.13 renamed the tensor forms; keep working on torch>=2.6.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Comm:
    """Collectives with accounting, device checks and timeouts. One per engine (groups are passed, not global)."""

    def __init__(self, timeout_s: float = 120.0, gloo_collectives: str = "shm", device: torch.device | None = None):
        if gloo_collectives not in ("shm", "exchange", "native"):
            raise ValueError(f"gloo_collectives={gloo_collectives!r}: expected 'shm', 'exchange' or 'native'")
        self.timeout_s = float(timeout_s)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stats = CommStats()
        self.clock = WaitClock()
        self.tensors_checked = 0     # tensors whose device was checked (the GPU self-check reports it)
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self._exchange_on_gloo = gloo_collectives != "native"
        self._shm_on_gloo = gloo_collectives == "shm"
        # ranks -> their shared-memory ring, if any: groups of the same ranks (world and dp without TP or PP)
        # share one, as they share the order of their collectives
        self._rings: dict[tuple[int, ...], shm.ShmRing | None] = {}
        self._gloo: dict[int, bool] = {}        # id(process group) -> it is gloo
        self._tags = exchange.TagSequence()
        self._seq: dict[str, int] = defaultdict(int)   # collectives issued per group (the roll call names them)
        self.finished_step = 0

    @property
    def wait_s(self) -> float:
        """Seconds blocked waiting for communication so far (the doctor's slow-sync check)."""
        return self.clock.total_s

    # -- where a group's tensors go ----------------------------------------------------------------
    def _is_gloo(self, group: Group) -> bool:
        gloo = self._gloo.get(id(group.pg))
        if gloo is None:
            gloo = self._gloo[id(group.pg)] = dist.get_backend(group.pg) == dist.Backend.GLOO
        return gloo

    def _check(self, op: str, group: Group, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise DeviceError(
                    f"rank {self.global_rank}: {op} on group '{group.name}' was handed a tensor on {t.device}, but "
                    f"this rank's collectives run on {self.device} (NCCL takes device tensors only): build it on "
                    "the engine's device (engine.device). This is a bug in the caller, not a lost peer.")
        self.tensors_checked += len(tensors)

    def _staged(self, group: Group) -> bool:
        """gloo on a GPU rank (its tensors are on the device, as _check made sure): the op runs on host copies."""
        return self.device.type != "cpu" and self._is_gloo(group)

    def _via_host(self, run, tensors: list[torch.Tensor], written: int, async_op: bool, output_only: bool = False):
        """Run `run(host copies)` (synchronously) and copy host copy `written` back (`output_only`: it is not
        read, so not copied over): gloo on a GPU rank, a configuration for sharing one GPU (tests, the
        self-check), not a fast path."""
        hosts = [torch.empty_like(t, device="cpu") if output_only and i == written
                 else t.detach().to("cpu") for i, t in enumerate(tensors)]   # host: gloo reads host memory
        run(hosts)
        tensors[written].copy_(hosts[written])
        return Handle(self, None, "staged", None) if async_op else None

    def transport(self, group: Group) -> str:
        """What carries the group's CPU collectives (after its first one): 'shm', 'exchange' (all-gather and
        reduce-scatter; all-reduce is gloo's) or 'native'."""
        if self._rings.get(group.ranks):
            return "shm"
        return "exchange" if self._exchange_on_gloo and group.pg is not None and self._is_gloo(group) else "native"

    def _ring(self, group: Group, t: torch.Tensor) -> shm.ShmRing | None:
        """The group's shared-memory ring for a host tensor, set up (collectively, inside _run: a rank that never
        comes is a CommError after the timeout) at the group's first collective."""
        ring = self._rings.get(group.ranks, False)
        if ring is False:
            ring = None
            if self._shm_on_gloo and self._is_gloo(group):
                ring = shm.ShmRing.open(group.pg, group.rank, group.ranks, self.timeout_s)
            self._rings[group.ranks] = ring
        return ring if ring is not None and t.device.type == "cpu" else None

    def _exchange_tag(self, group: Group) -> int | None:
        """The tag of the next exchange on `group`, or None where the backend's own collective runs."""
        return self._tags.next(group.name) if self._exchange_on_gloo and self._is_gloo(group) else None

    # -- errors and running ------------------------------------------------------------------------
    def error(self, op: str, group: Group, cause) -> CommError:
        from bunsan.comm.rollcall import roll_call, window_for
        seq = self._seq[group.name]
        text = str(cause).lower()
        head = (f"rank {self.global_rank}: {op} #{seq} on group '{group.name}' (ranks {list(group.ranks)}) "
                f"failed: {cause}.")
        # Another rank is to blame only for a timeout or a lost connection: then a roll call says where each is.
        if not any(w in text for w in ("timed out", "timeout", "connection", "closed", "reset", "peer", "broken",
                                       "remote", "watchdog")):
            return CommError(f"{head} The error is this rank's own (no peer was lost); this rank last finished "
                             f"step {self.finished_step}.")
        who = roll_call(self.global_rank, op, group, seq, window_s=window_for(self.timeout_s))
        return CommError(
            f"{head} Another rank probably died, hung or skipped this {op}; the collective timeout is "
            f"{self.timeout_s:g}s (train.timeout_s); this rank last finished step {self.finished_step}.{who}")

    def _run(self, op: str, group: Group, nbytes, fn, async_op: bool, after=None):
        """Run `fn` (-> a work object, a list of them, or None when it finished the op) as `op`; `nbytes` may be
        a function, called after `fn` (a receive learns its size from the message)."""
        if op not in ("send", "recv", "p2p"):     # point-to-point calls differ per rank: only collectives line up
            self._seq[group.name] += 1
        on_device = not self._is_gloo(group)
        token = self.clock.start(False) if not on_device else None
        try:
            work = fn()           # (an exchange or the shared memory on gloo may block here: count it as waiting)
        except RuntimeError as e:
            raise self.error(op, group, e) from e
        finally:
            if token is not None:
                self.clock.stop(token)
        if op != "p2p":
            self.stats.record(op, group.name, logical_bytes(op, nbytes() if callable(nbytes) else nbytes, group.size))
        handle = Handle(self, work, op, group, on_device, after)
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

    @staticmethod
    def _finished(op: str, group: Group, async_op: bool):
        return Handle(None, None, op, group) if async_op else None

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: Group, async_op: bool = False, op: str = "sum"):
        """In-place SUM (or MAX) all-reduce (gloo has no AVG: callers divide themselves)."""
        self._check("all_reduce", group, t)
        if group.size == 1:
            return self._finished("all_reduce", group, async_op)
        if self._staged(group):
            return self._via_host(lambda h: self._all_reduce(h[0], group, op, False), [t], 0, async_op)
        return self._all_reduce(t, group, op, async_op)

    def _all_reduce(self, t, group, op, async_op):
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        return self._collective("all_reduce", group, t, t.numel() * t.element_size(),
                                lambda ring: ring.all_reduce(t, op), None,
                                lambda: dist.all_reduce(t, op=red, group=group.pg, async_op=True), async_op)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False):
        """Gather equal shards into `out` (size N x shard)."""
        self._check("all_gather", group, out, shard)
        if group.size == 1:
            out.copy_(shard.view_as(out))
            return self._finished("all_gather", group, async_op)
        if self._staged(group):
            return self._via_host(lambda h: self._all_gather(h[0], h[1], group, False), [out, shard], 0, async_op,
                                  output_only=True)
        return self._all_gather(out, shard, group, async_op)

    def _all_gather(self, out, shard, group, async_op):
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
        self._check("reduce_scatter", group, out, full)
        if group.size == 1:
            out.copy_(full.view_as(out))
            return self._finished("reduce_scatter", group, async_op)
        if self._staged(group):
            return self._via_host(lambda h: self._reduce_scatter(h[0], h[1], group, False), [out, full], 0,
                                  async_op, output_only=True)
        return self._reduce_scatter(out, full, group, async_op)

    def _reduce_scatter(self, out, full, group, async_op):
        return self._collective(
            "reduce_scatter", group, full, full.numel() * full.element_size(),
            lambda ring: ring.reduce_scatter(out, full),
            lambda tag: exchange.reduce_scatter(out, full, group.ranks, group.rank, group.pg, tag),
            lambda: _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group.pg, async_op=True), async_op)

    def all_to_all(self, out: torch.Tensor, full: torch.Tensor, group: Group, async_op: bool = False):
        """Rank i's `full` cut in N equal pieces along dim 0: piece j goes to rank j, which keeps the pieces of
        every rank in `out` (same size as `full`), rank i's at piece i."""
        self._check("all_to_all", group, out, full)
        if full.shape[0] % group.size or out.shape != full.shape:
            raise ValueError(f"all_to_all cuts dim 0 in {group.size} equal pieces: got {tuple(full.shape)} into "
                             f"{tuple(out.shape)}")
        if group.size == 1:
            out.copy_(full)
            return self._finished("all_to_all", group, async_op)
        if self._staged(group):
            return self._via_host(lambda h: self._all_to_all(h[0], h[1], group, False), [out, full], 0, async_op,
                                  output_only=True)
        return self._all_to_all(out, full, group, async_op)

    def _all_to_all(self, out, full, group, async_op):
        return self._run("all_to_all", group, full.numel() * full.element_size(),
                         lambda: dist.all_to_all_single(out, full, group=group.pg, async_op=True), async_op)

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     group: Group) -> None:
        """Uneven all-to-all along dim 0 (expert parallelism's dispatch): in_splits[j] rows of `inp` to rank j,
        out_splits[j] rows from rank j into `out`, in rank order; the caller exchanged the counts. Accounted as
        the bytes this rank sends to the other ranks."""
        self._check("all_to_all_v", group, out, inp)
        if len(in_splits) != group.size or len(out_splits) != group.size:
            raise ValueError(f"all_to_all_v over {group.size} ranks takes {group.size} splits each way, got "
                             f"{len(in_splits)} to send and {len(out_splits)} to receive")
        if sum(in_splits) != inp.shape[0] or sum(out_splits) != out.shape[0]:
            raise ValueError(f"all_to_all_v splits {in_splits} -> {out_splits} do not add up to the rows of "
                             f"the input {tuple(inp.shape)} and output {tuple(out.shape)}")
        if group.size == 1:
            out.copy_(inp)
            return None
        row = math.prod(inp.shape[1:]) * inp.element_size()      # (a rank may send no rows at all)
        sent = (sum(in_splits) - in_splits[group.rank]) * row

        def run(tensors=(out, inp)):
            o, i = tensors
            return dist.all_to_all_single(o, i, output_split_sizes=list(out_splits),
                                          input_split_sizes=list(in_splits), group=group.pg, async_op=True)
        if self._staged(group):
            self._via_host(lambda h: self._run("all_to_all_v", group, sent, lambda: run(h), False),
                           [out, inp], 0, False, output_only=True)
            return None
        return self._run("all_to_all_v", group, sent, run, False)

    def broadcast(self, t: torch.Tensor, src_rank: int, group: Group, async_op: bool = False):
        """Broadcast from group-local rank `src_rank`."""
        self._check("broadcast", group, t)
        if group.size == 1:
            return self._finished("broadcast", group, async_op)
        if self._staged(group):
            return self._via_host(lambda h: self._broadcast(h[0], src_rank, group, False), [t], 0, async_op)
        return self._broadcast(t, src_rank, group, async_op)

    def _broadcast(self, t, src_rank, group, async_op):
        src = group.ranks[src_rank]
        return self._run("broadcast", group, t.numel() * t.element_size(),
                         lambda: dist.broadcast(t, src=src, group=group.pg, async_op=True), async_op)

    def all_reduce_scalars(self, values: list[float], group: Group) -> list[float]:
        """SUM a few float64 scalars across the group, read back on the host: a sync, so for set-up,
        checkpoints and evaluation, never inside the step (which reduces device tensors with all_reduce)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # host: read back below anyway
        self.all_reduce(t, group)
        return t.tolist()   # host: the caller wants the numbers

    def barrier(self, group: Group) -> None:
        """A one-element all-reduce on the device: on gloo every rank's host reaches this point; on NCCL it only
        orders the ranks' streams (the host goes on), which is what the pipeline's step start needs. A host
        barrier on NCCL reads a result back: all_reduce_scalars (as checkpoints do)."""
        if group.size > 1:
            self.all_reduce(torch.zeros(1, device=self.device), group)

    # -- point to point ------------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, group: Group, tag: int = 0):
        """Non-blocking send to global rank `dst` of `group`; wait() on the handle before reusing `t`."""
        return self.batch_p2p([P2POp("send", t, dst, tag)], group)[0]

    def irecv(self, t: torch.Tensor, src: int, group: Group, tag: int = 0):
        return self.batch_p2p([P2POp("recv", t, src, tag)], group)[0]

    def batch_p2p(self, ops: list[P2POp], group: Group) -> list[Handle]:
        """Post sends and receives together; a handle per op. On NCCL they are one group
        (torch.distributed.batch_isend_irecv, as Megatron posts them): NCCL ignores tags, a send may wait until its
        peer posts the receive, and a pair's operations share a stream, so a send and a receive between two
        neighbours posted one after the other can deadlock where one batch cannot (pipeline/schedules.py proves
        every schedule's batches deadlock-free under these rules). NCCL needs a collective on the group before its
        first batch (its communicator is made then): the pipeline's step barrier is one."""
        self._check("send/recv", group, *(o.tensor for o in ops))
        for o in ops:
            self.stats.record(o.kind, group.name, o.tensor.numel() * o.tensor.element_size())
        if not self._is_gloo(group):
            batch = [dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, o.peer, group.pg, o.tag)
                     for o in ops]
            handle = self._run("p2p", group, 0, lambda: list(dist.batch_isend_irecv(batch)), True)
            return [handle] * len(ops)
        return [self._gloo_p2p(o, group) for o in ops]

    def _gloo_p2p(self, o: P2POp, group: Group) -> Handle:
        if not self._staged(group):
            call = dist.isend if o.kind == "send" else dist.irecv
            return self._run("p2p", group, 0, lambda: call(o.tensor, o.peer, group=group.pg, tag=o.tag), True)
        # host: gloo reads host memory
        host = o.tensor.detach().to("cpu") if o.kind == "send" else torch.empty_like(o.tensor, device="cpu")
        if o.kind == "send":     # the handle keeps the host copy alive until the send completed
            return self._run("p2p", group, 0, lambda: dist.isend(host, o.peer, group=group.pg, tag=o.tag), True,
                             after=lambda: host)
        return self._run("p2p", group, 0, lambda: dist.irecv(host, o.peer, group=group.pg, tag=o.tag), True,
                         after=lambda: o.tensor.copy_(host))

    # -- point to point through shared memory (comm/mailbox.py) ----------------------------------
    def mailbox(self, group: Group) -> shm_mailbox.Mailbox | None:
        """Collective over `group`: shared-memory channels between its neighbouring ranks, where
        train.gloo_collectives is shm, the group is on gloo and its ranks share a host; else None (every rank)."""
        if not self._shm_on_gloo or group.size == 1 or not self._is_gloo(group):
            return None
        try:
            return shm_mailbox.Mailbox.open(group.pg, group.rank, group.ranks, self.timeout_s)
        except RuntimeError as e:
            raise self.error("mailbox set-up", group, e) from e

    def post(self, box: shm_mailbox.Mailbox, t: torch.Tensor, dst: int, group: Group, tag: int):
        """Send contiguous `t` to group rank `dst` through the mailbox; a handle to wait on before reusing `t`
        (a message no slot holds goes through gloo under tag + 1)."""
        self._check("send", group, t)
        host = t.detach().to("cpu") if t.device.type != "cpu" else t   # host: the mailbox is host memory

        def fn():
            if box.send(host, dst, tag):
                return None
            return dist.isend(host, dst=group.ranks[dst], group=group.pg, tag=tag + 1)
        return self._run("send", group, t.numel() * t.element_size(), fn, True, after=lambda: host)

    def fetch(self, box: shm_mailbox.Mailbox, src: int, group: Group, tag: int) -> torch.Tensor:
        """Receive what group rank `src` posted under `tag` (blocking), on this rank's device."""
        got: list[torch.Tensor] = []

        def fn():
            t, in_memory = box.recv(src, tag)
            got.append(t)
            return None if in_memory else dist.irecv(t, src=group.ranks[src], group=group.pg, tag=tag + 1)
        self._run("recv", group, lambda: got[0].numel() * got[0].element_size(), fn, False)
        return got[0].to(self.device)


def all_reduce_on(comm: Comm, group: Group, device: torch.device):
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
