"""Serving under tensor parallelism: rank 0 serves HTTP and runs the batcher; before each forward it broadcasts
the work (which blocks, which tokens) and every rank runs the same forward on its shard of the model and of
the KV cache (heads split over the group, the same blocks on every rank). Only rank 0 samples: the head
gathers the logits.

    order:   [kind, rows, tokens, blocks] then [block tables..., lengths..., counts..., token ids...]
             (tokens: every row's new ones, flattened; blocks: the widest row's table)
             kind: FORWARD, NOOP (heartbeat), STOP; the tables and lengths say where every row's keys go

While idle rank 0 sends a heartbeat every HEARTBEAT_S, so a follower that hears nothing for its collective
timeout knows rank 0 is gone and exits. A follower that dies makes rank 0's next broadcast or forward fail:
the batcher ends every request with an error and the server shuts down instead of hanging.
"""

from __future__ import annotations

import torch

FORWARD, NOOP, STOP = 1, 2, 3
HEARTBEAT_S = 1.0


class Leader:
    """Rank 0's side: announce each forward (and heartbeats, and the end) to the followers."""

    def __init__(self, comm, group, device: torch.device):
        self.comm, self.group, self.device = comm, group, device     # NCCL broadcasts device tensors

    def _send(self, values) -> None:
        self.comm.broadcast(torch.as_tensor(values, dtype=torch.long).to(self.device), 0, self.group)

    def forward(self, tables: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor) -> None:
        n, nb = tables.shape
        self._send([FORWARD, n, ids.numel(), nb])
        self._send(torch.cat([tables.reshape(-1), lengths, counts, ids.reshape(-1).cpu()]))

    def heartbeat(self) -> None:
        self._send([NOOP, 0, 0, 0])

    def stop(self) -> None:
        self._send([STOP, 0, 0, 0])


def follow(model, cache, comm, group, device: torch.device) -> None:
    """A follower's serving loop: run every forward rank 0 announces, until it says stop (or goes silent, which
    the collective timeout turns into an error)."""
    while True:
        header = torch.zeros(4, dtype=torch.long, device=device)
        comm.broadcast(header, 0, group)
        kind, n, tokens, nb = header.tolist()
        if kind == STOP:
            return
        if kind == NOOP:
            continue
        payload = torch.zeros(n * nb + 2 * n + tokens, dtype=torch.long, device=device)
        comm.broadcast(payload, 0, group)
        tables, lengths, counts, ids = payload.cpu().split([n * nb, n, n, tokens])
        with torch.no_grad():
            model(ids.view(1, tokens).to(cache.device), kv_cache=cache.view(tables.view(n, nb), lengths, counts))
