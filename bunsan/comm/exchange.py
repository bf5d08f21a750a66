"""All-gather and reduce-scatter as direct point-to-point exchanges, for gloo (collectives.py's, called only by it).

gloo has no native reduce-scatter: torch emulates it with an all-reduce of a copy
and then keeps a slice, moving a whole all-reduce for 1/N of the result, and its
all-gather is slower still (figures: benchmarks/RESULTS.md, gloo collectives).
ZeRO (stages 1-3) and sequence parallelism live on
these two collectives, so on gloo bunsan runs them as exchanges: every rank
sends each peer the chunk that peer owns (reduce-scatter) or its own shard
(all-gather), and receives the same. That moves (N-1)/N of the tensor per rank,
what a ring moves, with every transfer in flight at once and no dependent rounds.

Messages carry a tag from a per-group sequence: every rank issues a group's
collectives in the same order, so the k-th exchange on a group matches the k-th
on every peer, whatever else is in flight. Reduce-scatter sums in rank order,
so each chunk comes out the same as a sequential sum over ranks would give.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

TAG_BASE = 1 << 24   # leaves small tags free for pipeline sends and receives
TAG_SPAN = 1 << 24


class ExchangeWork:
    """The sends and receives of one exchange; wait() waits for all of them, then runs `finish`."""

    def __init__(self, works: list, finish=None):
        self.works, self.finish = works, finish

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self.works:
            if (w.wait(timeout) if timeout is not None else w.wait()) is False:
                return False
        self.works = []
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    flat = t.view(-1)
    size = flat.numel() // n
    return [flat[j * size:(j + 1) * size] for j in range(n)]


def all_gather(out: torch.Tensor, shard: torch.Tensor, ranks: tuple[int, ...], me: int, pg, tag: int) -> ExchangeWork:
    """`out` (N x shard elements) gets every rank's shard, in rank order."""
    parts = _chunks(out, len(ranks))
    if parts[me].data_ptr() != shard.data_ptr():
        parts[me].copy_(shard.reshape(-1))
    works = []
    for j, peer in enumerate(ranks):
        if j != me:
            works.append(dist.irecv(parts[j], src=peer, group=pg, tag=tag))
            works.append(dist.isend(parts[me], dst=peer, group=pg, tag=tag))
    return ExchangeWork(works)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, ranks: tuple[int, ...], me: int, pg,
                   tag: int) -> ExchangeWork:
    """`out` gets the sum over ranks of chunk `me` of `full`; `full` must stay untouched until wait()."""
    n = len(ranks)
    parts = _chunks(full, n)
    flat_out = out.view(-1)
    # Two ranks: receive straight into out and add ours (a + b == b + a exactly). More: one buffer per peer.
    received = {j: (flat_out if n == 2 else torch.empty_like(flat_out)) for j in range(n) if j != me}
    works = []
    for j, peer in enumerate(ranks):
        if j != me:
            works.append(dist.irecv(received[j], src=peer, group=pg, tag=tag))
            works.append(dist.isend(parts[j], dst=peer, group=pg, tag=tag))

    def finish() -> None:
        if n == 2:
            flat_out.add_(parts[me])
            return
        first = parts[me] if me == 0 else received[0]
        flat_out.copy_(first)
        for j in range(1, n):
            flat_out.add_(parts[me] if j == me else received[j])
    return ExchangeWork(works, finish)


class TagSequence:
    """The next tag for each group: identical on every rank as long as collectives are issued in order."""

    def __init__(self):
        self._next: dict[str, int] = {}

    def next(self, group_name: str) -> int:
        k = self._next.get(group_name, 0)
        self._next[group_name] = k + 1
        return TAG_BASE + k % TAG_SPAN
