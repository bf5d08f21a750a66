"""All-reduce, reduce-scatter and all-gather through shared memory, for the ranks of a group on one host.

collectives.py's, called only by it, for CPU tensors on gloo groups (`train.gloo_collectives: shm`, the default).
gloo moves every byte through loopback TCP, and on CPU that is work for the same cores that compute; shared
memory skips the sockets (figures: benchmarks/RESULTS.md, gloo collectives). Each rank owns a
slot in one mapped file; an operation is a few memcpy-sized tensor ops and one or two waits on the peers'
flags:

    all-reduce      copy in, flag, wait; sum my 1/N segment over all slots (rank order), flag, wait; copy out
    reduce-scatter  copy in (every rank's chunk), flag, wait; sum my chunk over all slots (rank order)
    all-gather      copy in, flag, wait; copy every slot out

Each rank's flag counts the phases it has finished; a phase waits until every flag has reached it. Two sets
of slots alternate between operations: a rank writes a set only after every rank passed a later flag, which
each sets only after it finished reading that set. Tensors larger than a slot go in slot-sized chunks.

Ordering: the data is written by ordinary (or fenced non-temporal) stores before the flag's store, and read
after the flag's load; x86-64's memory model keeps those in order, so shared memory is used only there.

Set-up is collective: group rank 0 creates an anonymous shared file (memfd: it never has a name, so nothing
can be left behind, whatever kills the job) and broadcasts where its peers can open it (/proc/<pid>/fd/<fd>)
with the host's boot id and PID namespace; every rank on the same kernel and namespace maps it and checks a
token, all agree (a MIN all-reduce on gloo) and rank 0 closes its descriptor. Where any rank cannot map it
(another host or container, no memfd, too little memory, not x86-64), no rank uses it. A peer process that
exits is noticed within a second; one that stops coming is an error after the timeout.
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import struct
import time
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20          # per rank and set; larger tensors go in chunks of this
_HEADER = 4096                # flags (int64 per rank), pids (int64 per rank), the token
_PIDS_AT = 1024
_TOKEN_AT = 2048
_NOTE = 256                   # bytes of the set-up broadcast: rank 0's pid and fd, host identity, token
_SPINS = 64                   # busy polls before yielding the core (ranks may outnumber cores)


class ShmTimeout(RuntimeError):
    """A peer did not reach a phase within the timeout (collectives.py turns it into a CommError)."""


def ring_bytes(n: int) -> int:
    """Shared memory of one ring of `n` ranks (mapped by each of them; the estimator counts it)."""
    return _HEADER + 2 * n * SLOT_BYTES


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _host() -> bytes:
    """This kernel (boot id) and PID namespace: where /proc/<pid> names the same process."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        return boot + b"/" + os.readlink("/proc/self/ns/pid").encode()
    except OSError:
        return b""


def _create(size: int, token: bytes) -> int | None:
    """An anonymous shared file of `size` bytes with the token written in; its descriptor, or None."""
    if not hasattr(os, "memfd_create"):
        return None
    try:
        fd = os.memfd_create("bunsan-shm")
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)     # reserve the pages now: no memory fails here, not with SIGBUS later
        os.pwrite(fd, token, _TOKEN_AT)
        return fd
    except OSError:
        os.close(fd)
        return None


def _map(path: str, size: int) -> torch.Tensor:
    """Map an existing shared file (never creating one) as a uint8 tensor."""
    fd = os.open(path, os.O_RDWR | os.O_NOCTTY)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} is not a ring of {size} bytes")
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)                        # the mapping keeps the memory
    with torch.inference_mode(False):       # a normal tensor, even if the first collective runs in inference
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _alive(pid: int) -> bool:
    """Whether a peer's process still runs (a zombie, exited but not yet reaped by its parent, does not)."""
    if pid <= 0:
        return True                         # not yet written: nothing to judge by
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def open_shared(pg, rank: int, ranks: tuple[int, ...], total: int, timeout_s: float) -> torch.Tensor | None:
    """Collective over `pg` (gloo), each step waited for at most `timeout_s`: `total` bytes of shared memory,
    the first _HEADER of them a header with each rank's pid at _PIDS_AT, that every rank mapped; or None on
    every rank."""
    size = len(ranks)
    wait = datetime.timedelta(seconds=timeout_s)
    host = _host()
    note = torch.zeros(_NOTE, dtype=torch.uint8)    # [pid, fd, token, host identity] of rank 0's file
    fd = None
    if rank == 0 and _x86() and host and 8 * size <= _TOKEN_AT - _PIDS_AT and 32 + len(host) < _NOTE:
        token = uuid.uuid4().bytes
        fd = _create(total, token)
        if fd is not None:
            head = struct.pack("<qq", os.getpid(), fd) + token + host
            note[:len(head)] = torch.tensor(list(head), dtype=torch.uint8)
    buf = None
    try:
        dist.broadcast(note, src=ranks[0], group=pg, async_op=True).wait(wait)
        raw = bytes(note.tolist())
        pid, at = struct.unpack("<qq", raw[:16])
        token, theirs = raw[16:32], raw[32:32 + len(host)]
        if pid and _x86() and host and 32 + len(host) < _NOTE and theirs == host and raw[32 + len(host)] == 0:
            try:
                buf = _map(f"/proc/{pid}/fd/{at}", total)
                if bytes(buf[_TOKEN_AT:_TOKEN_AT + 16].tolist()) != token:
                    buf = None      # not the file rank 0 made
            except OSError:
                buf = None
        ok = torch.tensor([1 if buf is not None else 0], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg, async_op=True).wait(wait)
    finally:                        # every rank mapped it (or gave up, or failed): the descriptor goes
        if fd is not None:
            os.close(fd)
    if not int(ok):
        return None
    buf[_PIDS_AT + 8 * rank:_PIDS_AT + 8 * (rank + 1)].view(torch.int64)[0] = os.getpid()
    return buf


def wait_until(ready, timeout_s: float, waiting_for, what: str) -> None:
    """Poll `ready()` (busy at first, then yielding the core) until it holds. `waiting_for()` -> [(rank, pid)]
    of the peers it waits on: one whose process is gone fails within a second, else after `timeout_s`."""
    spins, start = 0, None
    while not ready():
        spins += 1
        if spins <= _SPINS:
            continue
        os.sched_yield()
        if spins % 256:
            continue
        now = time.monotonic()
        if start is None:
            start = checked = now
        if now - checked > 1.0:                 # a peer process that is gone will never come
            checked = now
            gone = [r for r, pid in waiting_for() if not _alive(pid)]
            if gone:
                raise ShmTimeout(f"{what} in shared memory: the process of rank(s) {gone} exited")
        if now - start > timeout_s:
            raise ShmTimeout(f"{what} timed out after {timeout_s:g}s in shared memory waiting for "
                             f"rank(s) {[r for r, _ in waiting_for()]}")


class ShmRing:
    """Shared slots of one group's ranks; see the module docstring for the protocol."""

    def __init__(self, buf: torch.Tensor, size: int, rank: int, ranks: tuple[int, ...], slot_bytes: int,
                 timeout_s: float):
        self.size, self.rank, self.ranks, self.slot_bytes, self.timeout_s = size, rank, ranks, slot_bytes, timeout_s
        self.flags = buf[:8 * size].view(torch.int64).numpy()         # a numpy view: cheap loads and stores
        self.pids = buf[_PIDS_AT:_PIDS_AT + 8 * size].view(torch.int64).numpy()
        self.data = buf[_HEADER:].view(2, size, slot_bytes)
        self.phase, self.ops = 0, 0
        self.broken: str | None = None

    @classmethod
    def open(cls, pg, rank: int, ranks: tuple[int, ...], timeout_s: float,
             slot_bytes: int | None = None) -> "ShmRing | None":
        """Collective over `pg` (gloo), each step waited for at most `timeout_s`: a ring every rank mapped, or
        None on every rank."""
        size, slot_bytes = len(ranks), slot_bytes or SLOT_BYTES
        buf = open_shared(pg, rank, ranks, _HEADER + 2 * size * slot_bytes, timeout_s)  # ring_bytes(size)
        return None if buf is None else cls(buf, size, rank, ranks, slot_bytes, timeout_s)

    # -- phases ------------------------------------------------------------------------------------
    def _sync(self, op: str) -> None:
        """Finish a phase: raise my flag and wait until every rank's has reached it."""
        self.phase += 1
        g, f = self.phase, self.flags
        f[self.rank] = g
        if f.min() >= g:
            return
        try:
            wait_until(lambda: f.min() >= g, self.timeout_s,
                       lambda: [(self.ranks[r], int(self.pids[r])) for r in range(self.size) if f[r] < g], op)
        except ShmTimeout as e:
            self.broken = str(e)
            raise

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """This operation's set of slots, [ranks, slot elements] of `dtype`."""
        if self.broken:
            raise ShmTimeout(f"shared-memory ring unusable after an earlier failure: {self.broken}")
        s = self.data[self.ops % 2]
        self.ops += 1
        return s.view(dtype)

    def _sum(self, parts: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
        """out = parts[0] (+) parts[1] (+) ... in rank order; `out` may be one of the parts only if it is parts[0]
        or there are two parts."""
        fn = torch.add if op == "sum" else torch.maximum
        if len(parts) == 2:
            fn(parts[0], parts[1], out=out)
            return
        acc = fn(parts[0], parts[1])
        for p in parts[2:]:
            fn(acc, p, out=acc)
        out.copy_(acc)

    # -- collectives ---------------------------------------------------------------------------------
    @torch.no_grad()      # copies and sums of communication, in no one's autograd graph
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        c = t if t.is_contiguous() else t.contiguous()
        flat, n = c.view(-1), self.size
        cap = self.slot_bytes // c.element_size()
        for s in range(0, flat.numel(), cap):
            chunk = flat[s:s + cap]
            m = chunk.numel()
            slots = self._slots(c.dtype)
            slots[self.rank, :m].copy_(chunk)
            self._sync("all_reduce")
            seg = -(-m // n)
            lo, hi = min(m, self.rank * seg), min(m, (self.rank + 1) * seg)
            if lo < hi:         # my segment, summed into my own slot (no peer reads it there until the flag)
                self._sum([slots[r, lo:hi] for r in range(n)], slots[self.rank, lo:hi], op)
            self._sync("all_reduce")
            for r in range(n):
                a, b = min(m, r * seg), min(m, (r + 1) * seg)
                if a < b:
                    chunk[a:b].copy_(slots[r, a:b])
        if c is not t:
            t.copy_(c)

    @torch.no_grad()
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        n, shard = self.size, out.numel()
        rows = (full if full.is_contiguous() else full.contiguous()).view(n, shard)
        dense = torch.contiguous_format
        res = out if out.is_contiguous() else torch.empty_like(out, memory_format=dense)
        res_flat = res.view(-1)
        cap = self.slot_bytes // full.element_size() // n
        for j in range(0, shard, cap):
            m = min(cap, shard - j)
            slots = self._slots(full.dtype)
            slots[self.rank, :n * m].view(n, m).copy_(rows[:, j:j + m])
            self._sync("reduce_scatter")
            self._sum([slots[r, self.rank * m:(self.rank + 1) * m] for r in range(n)], res_flat[j:j + m], "sum")
        if res is not out:
            out.copy_(res)

    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        n = self.size
        src = (shard if shard.is_contiguous() else shard.contiguous()).view(-1)
        k = src.numel()
        dense = torch.contiguous_format
        res = out if out.is_contiguous() else torch.empty_like(out, memory_format=dense)
        rows = res.view(n, k)
        cap = self.slot_bytes // shard.element_size()
        for j in range(0, k, cap):
            m = min(cap, k - j)
            slots = self._slots(shard.dtype)
            slots[self.rank, :m].copy_(src[j:j + m])
            self._sync("all_gather")
            rows[:, j:j + m].copy_(slots[:, :m])
        if res is not out:
            out.copy_(res)
