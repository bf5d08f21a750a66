"""The error-compensated 1-bit all-reduce of 1-bit Adam, 0/1 Adam and 1-bit LAMB (Tang et al. 2021, as
DeepSpeed's compressed_allreduce): every element travels as its sign, every tensor piece with one scale.

    worker:  x += worker_error;  s = ||x|| / sqrt(n);  c = s * sign(x);  worker_error = x - c
    server (rank r owns chunk r of every tensor):
             y = mean over ranks of their c[chunk r] + server_error;  s' = ||y|| / sqrt(n / N)
             c' = s' * sign(y);  server_error = y - c'
    result:  every rank gathers the servers' c': the same averaged tensor everywhere

sign(0) counts as +1. The signs go as packed bits (uint8, 8 per byte), so a tensor costs n/8 bytes per phase
instead of 4n: phase 1 is an all-to-all of the packed signs (each server receives its chunk from every rank,
as DeepSpeed's compressed_allreduce), phase 2 an all-gather of the servers' chunks; the scales, one float per
rank, are all-gathered. Through Comm, so the bytes are recorded as every other collective's.
"""

from __future__ import annotations

import torch

from bunsan.comm.collectives import Comm
from bunsan.comm.work import Group

__all__ = ["OneBitAllReduce", "padded_size"]

_BITS: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    """1, 2, 4, ..., 128 on `device`, made there once (not copied from the host at every compressed step)."""
    if device not in _BITS:
        _BITS[device] = 2 ** torch.arange(8, dtype=torch.uint8, device=device)
    return _BITS[device]


def padded_size(numel: int, ranks: int) -> int:
    """Elements after padding: whole bytes of signs in every rank's chunk."""
    unit = 8 * ranks
    return -(-numel // unit) * unit


def _pack(positive: torch.Tensor) -> torch.Tensor:
    return (positive.view(-1, 8).to(torch.uint8) * _bits(positive.device)).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """+1.0 / -1.0 per bit."""
    bits = (packed.unsqueeze(-1) & _bits(packed.device)) != 0
    return bits.reshape(*packed.shape[:-1], -1).float() * 2.0 - 1.0


def _compress(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, scale) of x + error; error becomes what the compression lost."""
    x = x + error
    scale = torch.linalg.vector_norm(x) / (x.numel() ** 0.5)
    positive = x >= 0
    error.copy_(x - scale * (positive.float() * 2.0 - 1.0))
    return _pack(positive), scale.reshape(1)


class OneBitAllReduce:
    """The compressed average of one tensor over `group`, with the error buffers it carries between steps."""

    def __init__(self, comm: Comm, group: Group, numel: int, device: torch.device):
        self.comm, self.group, self.numel = comm, group, numel
        self.size = padded_size(numel, group.size)
        self.chunk = self.size // group.size
        self.worker_error = torch.zeros(self.size, device=device)
        self.server_error = torch.zeros(self.chunk, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (any shape, fp32) replaced by the compressed average over the group; returned."""
        n = ranks = self.group.size
        flat = torch.zeros(self.size, device=x.device)
        flat[:self.numel] = x.detach().reshape(-1).float()
        signs, scale = _compress(flat, self.worker_error)
        per_rank = self.chunk // 8
        my_chunks = torch.empty(ranks, per_rank, dtype=torch.uint8, device=x.device)   # every rank's chunk `rank`
        all_scales = torch.empty(ranks, 1, device=x.device)
        self.comm.all_to_all(my_chunks, signs.view(ranks, per_rank), self.group)
        self.comm.all_gather(all_scales, scale, self.group)
        mine = _unpack(my_chunks)      # [ranks, chunk]
        averaged = (mine * all_scales).sum(0) / n
        server_signs, server_scale = _compress(averaged, self.server_error)
        gathered_signs = torch.empty(ranks, server_signs.numel(), dtype=torch.uint8, device=x.device)
        gathered_scales = torch.empty(ranks, 1, device=x.device)
        self.comm.all_gather(gathered_signs, server_signs, self.group)
        self.comm.all_gather(gathered_scales, server_scale, self.group)
        result = (_unpack(gathered_signs) * gathered_scales).reshape(-1)[:self.numel]
        x.copy_(result.view_as(x).to(x.dtype))
        return x
