"""Every stage's tensors (and step timelines) to every stage: the whole model from a pipeline, no pickle.

Each stage in turn broadcasts a JSON list of (key, dtype, shape), then the tensors.
Keys are the plain model's (StageModule keeps the original paths); a weight tied
across stages arrives under each of its names, as the plain model's state_dict has it.
"""

from __future__ import annotations

import json

import torch

from bunsan.pipeline.timeline import Interval


def _broadcast_json(obj, src: int, comm, group, device: torch.device):
    """`obj` (JSON-able, on rank `src` of the group) on every rank: its length, then its UTF-8 bytes."""
    mine = src == group.rank
    blob = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device) if mine else None
    size = torch.tensor([blob.numel() if mine else 0], dtype=torch.int64, device=device)
    comm.broadcast(size, src, group)
    if not mine:
        blob = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.broadcast(blob, src, group)
    return json.loads(bytes(blob.cpu().tolist()).decode())


def gather_stages(state: dict[str, torch.Tensor], comm, group, device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for src in range(group.size):
        mine = src == group.rank
        meta = [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in state.items()] if mine else None
        for key, dtype, shape in _broadcast_json(meta, src, comm, group, device):
            t = state[key].to(device) if mine else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            comm.broadcast(t, src, group)
            out.setdefault(key, t.cpu())
    return out


def gather_intervals(intervals: list[Interval], comm, group, device: torch.device) -> list[list[Interval]]:
    """Every pipeline rank's timeline of the last step, on every rank: kinds and row count as JSON, numbers as a
    tensor."""
    out = []
    for src in range(group.size):
        mine = src == group.rank
        kinds = sorted({iv.kind for iv in intervals}) if mine else None
        kinds, n = _broadcast_json([kinds, len(intervals)] if mine else None, src, comm, group, device)
        if mine:
            rows = torch.tensor([[kinds.index(iv.kind), iv.micro, iv.chunk, iv.start, iv.end] for iv in intervals],
                                dtype=torch.float64, device=device).reshape(-1, 5)
        else:
            rows = torch.empty(n, 5, dtype=torch.float64, device=device)
        comm.broadcast(rows, src, group)
        out.append([Interval(kinds[int(k)], int(m), int(c), float(a), float(b)) for k, m, c, a, b in rows.tolist()])
    return out
