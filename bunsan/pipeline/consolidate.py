"""Every stage's tensors (and step timelines) to every stage: the whole model from a pipeline, no pickle.

Each stage in turn broadcasts a JSON list of (key, dtype, shape), then the tensors.
Keys are the plain model's (StageModule keeps the original paths); a weight tied
across stages arrives under each of its names, as the plain model's state_dict has it.
"""

from __future__ import annotations

import json

import torch

from .timeline import Interval


def gather_stages(state: dict[str, torch.Tensor], comm, group, device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for src in range(group.size):
        if src == group.rank:
            meta = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in state.items()])
            blob = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8).to(device)
            size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        comm.broadcast(size, src, group)
        if src != group.rank:
            blob = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        comm.broadcast(blob, src, group)
        for key, dtype, shape in json.loads(bytes(blob.cpu().tolist()).decode()):
            t = state[key].to(device) if src == group.rank else torch.empty(shape, dtype=getattr(torch, dtype),
                                                                              device=device)
            comm.broadcast(t, src, group)
            out.setdefault(key, t.cpu())
    return out


def gather_intervals(intervals: list[Interval], comm, group, device: torch.device) -> list[list[Interval]]:
    """Every pipeline rank's timeline of the last step, on every rank: kinds as JSON, numbers as a tensor."""
    out = []
    for src in range(group.size):
        if src == group.rank:
            kinds = sorted({iv.kind for iv in intervals})
            blob = torch.frombuffer(bytearray(json.dumps(kinds).encode()), dtype=torch.uint8).to(device)
            rows = torch.tensor([[kinds.index(iv.kind), iv.micro, iv.chunk, iv.start, iv.end] for iv in intervals],
                                dtype=torch.float64, device=device).reshape(-1, 5)
            sizes = torch.tensor([blob.numel(), rows.shape[0]], dtype=torch.int64, device=device)
        else:
            sizes = torch.zeros(2, dtype=torch.int64, device=device)
        comm.broadcast(sizes, src, group)
        if src != group.rank:
            blob = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
            rows = torch.empty(int(sizes[1]), 5, dtype=torch.float64, device=device)
        comm.broadcast(blob, src, group)
        comm.broadcast(rows, src, group)
        kinds = json.loads(bytes(blob.cpu().tolist()).decode())
        out.append([Interval(kinds[int(k)], int(m), int(c), float(a), float(b)) for k, m, c, a, b in rows.tolist()])
    return out
