"""Serving under tensor parallelism: rank 0 serves HTTP and runs the batcher; before each forward it broadcasts
the work (which slots, which tokens) and every rank runs the same forward on its shard of the model and of
the KV cache (heads split over the group). Only rank 0 samples: the head gathers the logits.

    order:   [kind, rows, tokens] then [slot ids..., their lengths..., token ids...]
             kind: FORWARD, NOOP (heartbeat), STOP; the lengths make every rank's cache agree with rank 0's
             or [COPY, src, dst, n]: slot dst takes slot src's first n positions (a shared prefix)

While idle rank 0 sends a heartbeat every HEARTBEAT_S, so a follower that hears nothing for its collective
timeout knows rank 0 is gone and exits. A follower that dies makes rank 0's next broadcast or forward fail:
the batcher ends every request with an error and the server shuts down instead of hanging.
"""

from __future__ import annotations

import torch

FORWARD, NOOP, STOP, COPY = 1, 2, 3, 4
HEARTBEAT_S = 1.0


class Leader:
    """Rank 0's side: announce each forward (and heartbeats, and the end) to the followers."""

    def __init__(self, comm, group, device: torch.device):
        self.comm, self.group, self.device = comm, group, device     # NCCL broadcasts device tensors

    def _send(self, values) -> None:
        self.comm.broadcast(torch.as_tensor(values, dtype=torch.long).to(self.device), 0, self.group)

    def forward(self, rows: list[int], lengths: torch.Tensor, ids: torch.Tensor) -> None:
        self._send([FORWARD, len(rows), ids.shape[1]])
        self._send(torch.cat([torch.tensor(rows), lengths.cpu(), ids.reshape(-1).cpu()]))

    def copy(self, src: int, dst: int, n: int) -> None:
        self._send([COPY, 0, 0])
        self._send([src, dst, n])

    def heartbeat(self) -> None:
        self._send([NOOP, 0, 0])

    def stop(self) -> None:
        self._send([STOP, 0, 0])


def follow(model, cache, comm, group, device: torch.device) -> None:
    """A follower's serving loop: run every forward rank 0 announces, until it says stop (or goes silent, which
    the collective timeout turns into an error)."""
    while True:
        header = torch.zeros(3, dtype=torch.long, device=device)
        comm.broadcast(header, 0, group)
        kind, n, s = header.tolist()
        if kind == STOP:
            return
        if kind == NOOP:
            continue
        if kind == COPY:
            order = torch.zeros(3, dtype=torch.long, device=device)
            comm.broadcast(order, 0, group)
            cache.copy(*order.tolist())
            continue
        payload = torch.zeros(2 * n + n * s, dtype=torch.long, device=device)
        comm.broadcast(payload, 0, group)
        payload = payload.cpu()
        rows, ids = payload[:n].tolist(), payload[2 * n:].view(n, s).to(cache.device)
        cache.lengths[payload[:n]] = payload[n:2 * n]
        with torch.no_grad():
            model(ids, kv_cache=cache.view(rows, s))
