"""Point-to-point messages through shared memory between neighbouring ranks of a pipeline group on one host.

collectives.py's (Comm.mailbox, post, fetch), for the pipeline's activations and gradients (pipeline/runtime.py) where
`train.gloo_collectives: shm` and the group's ranks share a host (the set-up is shm.open_shared's). gloo sends a
header and then the tensor over loopback TCP, two round trips on the critical path of every stage boundary;
here a send is one copy into shared memory and a receive one copy out.

Each ordered pair of neighbouring ranks (i -> i+1 and i -> i-1, cyclic) has a channel: a table of DESCS
descriptors (state, tag, slot, dtype, shape) and SLOTS data slots of SLOT_BYTES. A send copies the tensor into
a free slot and then publishes a descriptor; it never waits for the receiver. A receive waits for the
descriptor with its tag (messages may be received in any order), copies the data out, then frees the slot and
the descriptor. A message larger than a slot, or sent while every slot is taken, goes through gloo under its
own tag and its descriptor says so: the receiver always learns of a message from its descriptor.

Ordering (x86-64, as in shm.py): the sender stores the data, then the descriptor's fields, then its state; the
receiver loads the state, then the fields and the data, then stores the slot's and the descriptor's release.
"""

from __future__ import annotations

import numpy as np
import torch

from bunsan.comm import shm

DESCS = 1024                  # descriptors per channel: more than a step's messages can ever leave unread
SLOTS = 4
SLOT_BYTES = 4 << 20
_FIELDS = 16                  # state, tag, slot, dtype code, ndim, nbytes, dims (up to 8), 2 spare
_MAX_DIMS = 8
# a message's dtype as a code: in the mailbox's descriptors and the pipeline's gloo header alike
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool]
_DESC_BYTES = DESCS * _FIELDS * 8


def _channel_bytes() -> int:
    return _DESC_BYTES + SLOTS * 8 + SLOTS * SLOT_BYTES


def neighbour_pairs(p: int) -> list[tuple[int, int]]:
    """The ordered (sender, receiver) pairs of a pipeline of p ranks: each rank's next and previous."""
    return sorted({(i, (i + 1) % p) for i in range(p)} | {(i, (i - 1) % p) for i in range(p)} if p > 1 else set())


def mailbox_bytes(p: int) -> int:
    """Shared memory of one pipeline group's mailbox, mapped by each of its ranks."""
    return shm._HEADER + len(neighbour_pairs(p)) * _channel_bytes()


def resident_bytes(p: int, message_bytes: float) -> float:
    """What of it one rank touches (the estimator counts it): the slots of the channels to and from its
    neighbours, each as far as a message reaches."""
    channels = sum(0 in pair for pair in neighbour_pairs(p))
    return channels * SLOTS * min(message_bytes, SLOT_BYTES)


class _Channel:
    def __init__(self, buf: torch.Tensor, slots: int, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.descs = buf[:_DESC_BYTES].view(torch.int64).view(DESCS, _FIELDS).numpy()
        self.slots = buf[_DESC_BYTES:_DESC_BYTES + slots * 8].view(torch.int64).numpy()
        self.data = buf[_DESC_BYTES + slots * 8:].view(slots, slot_bytes)


class Mailbox:
    """Channels between the neighbouring ranks of one group; see the module docstring."""

    def __init__(self, buf: torch.Tensor, rank: int, ranks: tuple[int, ...], timeout_s: float):
        self.rank, self.ranks, self.timeout_s = rank, ranks, timeout_s
        self.pids = buf[shm._PIDS_AT:shm._PIDS_AT + 8 * len(ranks)].view(torch.int64).numpy()
        size = _channel_bytes()          # (SLOTS and SLOT_BYTES as at set-up: every rank read the same)
        self.channels = {pair: _Channel(buf[shm._HEADER + i * size:shm._HEADER + (i + 1) * size], SLOTS, SLOT_BYTES)
                         for i, pair in enumerate(neighbour_pairs(len(ranks)))}

    @classmethod
    def open(cls, pg, rank: int, ranks: tuple[int, ...], timeout_s: float) -> "Mailbox | None":
        """Collective over `pg` (gloo): a mailbox every rank mapped, or None on every rank."""
        buf = shm.open_shared(pg, rank, ranks, mailbox_bytes(len(ranks)), timeout_s)
        return None if buf is None else cls(buf, rank, ranks, timeout_s)

    def _peer(self, r: int) -> list[tuple[int, int]]:
        return [(self.ranks[r], int(self.pids[r]))]

    def _channel(self, src: int, dst: int) -> _Channel:
        ch = self.channels.get((src, dst))
        if ch is None:
            raise ValueError(f"group ranks {src} -> {dst} are not pipeline neighbours; the mailbox only joins "
                             "each rank to its next and previous")
        return ch

    def send(self, t: torch.Tensor, dst: int, tag: int) -> bool:
        """Publish contiguous CPU `t` for group rank `dst` under `tag`. False: no slot took it, and the caller
        sends it through gloo (under tag + 1) for the receiver to fetch there."""
        if t.dtype not in DTYPES or t.dim() > _MAX_DIMS:
            raise ValueError(f"the pipeline mailbox carries {DTYPES} of up to {_MAX_DIMS} dims; got {t.dtype} "
                             f"of shape {tuple(t.shape)}")
        ch = self._channel(self.rank, dst)
        free = np.flatnonzero(ch.descs[:, 0] == 0)
        if not free.size:           # more messages unread than a step can leave: wait for the receiver
            shm.wait_until(lambda: bool((ch.descs[:, 0] == 0).any()), self.timeout_s, lambda: self._peer(dst),
                           "send")
            free = np.flatnonzero(ch.descs[:, 0] == 0)
        d = int(free[0])
        nbytes = t.numel() * t.element_size()
        slot = -1
        if nbytes <= ch.slot_bytes:
            idle = np.flatnonzero(ch.slots == 0)
            if idle.size:
                slot = int(idle[0])
                ch.slots[slot] = 1
                if nbytes:
                    ch.data[slot, :nbytes].copy_(t.reshape(-1).view(torch.uint8))
        row = np.zeros(_FIELDS, dtype=np.int64)
        row[1:6] = (tag, slot, DTYPES.index(t.dtype), t.dim(), nbytes)
        row[6:6 + t.dim()] = t.shape
        ch.descs[d, 1:] = row[1:]
        ch.descs[d, 0] = 1           # published last
        return slot >= 0

    def recv(self, src: int, tag: int) -> tuple[torch.Tensor, bool]:
        """The tensor group rank `src` sent under `tag`, and whether it came through shared memory (else the
        caller receives it from gloo, under tag + 1, into the returned empty tensor)."""
        ch = self._channel(src, self.rank)
        hit: list[int] = []

        def arrived() -> bool:
            found = np.flatnonzero((ch.descs[:, 0] == 1) & (ch.descs[:, 1] == tag))
            if found.size:
                hit.append(int(found[0]))
            return bool(found.size)
        if not arrived():
            shm.wait_until(arrived, self.timeout_s, lambda: self._peer(src), "recv")
        d = hit[0]
        row = ch.descs[d].copy()
        slot, code, ndim, nbytes = (int(v) for v in row[2:6])
        out = torch.empty([int(v) for v in row[6:6 + ndim]], dtype=DTYPES[code])
        if slot >= 0:
            if nbytes:
                out.reshape(-1).view(torch.uint8).copy_(ch.data[slot, :nbytes])
            ch.slots[slot] = 0
        ch.descs[d, 0] = 0           # released last
        return out, slot >= 0
