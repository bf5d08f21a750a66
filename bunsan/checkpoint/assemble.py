"""Any layout's elements from any other layout's pieces.

A target is a rank's local tensor (pieces.Local) and a flat range [lo, hi) of it. When the
checkpoint's pieces of that tensor were written with the same local placement (same tensor-parallel
slice), the range is read straight from the pieces that overlap it, nothing else. Otherwise (another
tensor-parallel size) each source slice is rebuilt whole, its overlap with the target copied into the
target's local tensor, and the range cut from that; the rebuilt local tensor is cached for the other
ranges of the same tensor.
"""

from __future__ import annotations

import math

import torch

from bunsan.checkpoint.pieces import Local
from bunsan.checkpoint.store import CheckpointError, Reader


def _same_place(p: dict, t: Local) -> bool:
    return tuple(p["local_shape"]) == t.local_shape and p["tp_dim"] == t.tp_dim and p["start"] == t.start \
        and p.get("sections", 1) == t.sections and p.get("expert_start") == t.expert_start


def _check_shape(pieces: list[dict], t: Local, kind: str) -> None:
    shape = tuple(pieces[0]["shape"])
    if shape != t.global_shape:
        raise CheckpointError(f"{kind} of {t.name!r} has shape {list(shape)} in the checkpoint and "
                              f"{list(t.global_shape)} in this model; the checkpoint is of another model shape")


def _covered(pieces: list[dict], lo: int, hi: int, out: torch.Tensor, reader: Reader) -> int:
    """Copy the parts of [lo, hi) the pieces hold into out; the number of elements copied."""
    got = 0
    for p in pieces:
        a, b = max(lo, p["lo"]), min(hi, p["hi"])
        if a < b:
            out[a - lo:b - lo] = reader.read(p, a - p["lo"], b - p["lo"])
            got += b - a
    return got


def _rebuild(pieces: list[dict], reader: Reader, dtype: torch.dtype) -> dict[tuple, tuple[Local, torch.Tensor]]:
    """Every source local tensor, whole, keyed by its placement."""
    out: dict[tuple, tuple[Local, torch.Tensor]] = {}
    for p in pieces:
        key = (tuple(p["local_shape"]), p["tp_dim"], p["start"], p.get("sections", 1), p.get("expert_start"))
        if key not in out:
            src = Local(p["name"], tuple(p["shape"]), *key)
            out[key] = (src, torch.zeros(math.prod(key[0]), dtype=dtype))
        out[key][1][p["lo"]:p["hi"]] = reader.read(p)
    return out


def _target_tensor(reader: Reader, t: Local, kind: str, pieces: list[dict]) -> torch.Tensor:
    cache_key = (t, kind)
    if cache_key in reader.cache:
        return reader.cache[cache_key]
    dtype = reader.read(pieces[0], 0, 1).dtype
    local = torch.zeros(t.local_shape, dtype=dtype)
    sources = list(_rebuild(pieces, reader, dtype).values())
    # a fused projection split by sections on either side: both placed in the view with sections as a dimension
    sectioned = [x for x in [t] + [src for src, _ in sources] if x.sections > 1]
    sections, dim = (sectioned[0].sections, sectioned[0].tp_dim) if sectioned else (1, None)
    place = (lambda x: x.viewed(sections, dim)) if sections > 1 else (lambda x: x)
    try:
        target, sources = place(t), [(place(src), flat) for src, flat in sources]
    except ValueError as e:
        raise CheckpointError(f"{kind} of {e}; the checkpoint and this model split it differently") from None
    want, local_view = target.region(), local.view(target.local_shape)
    for src, flat in sources:
        have = src.region()
        inter = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(want, have)]
        if any(a >= b for a, b in inter):
            continue
        s = flat.view(src.local_shape)
        d = local_view
        for dim, (a, b) in enumerate(inter):
            s = s.narrow(dim, a - have[dim][0], b - a)
            d = d.narrow(dim, a - want[dim][0], b - a)
        d.copy_(s)
    reader.cache = {cache_key: local.view(-1)}   # one tensor at a time: ranges of it come in a row
    return reader.cache[cache_key]


def read_local(reader: Reader, t: Local, kind: str, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the target's local tensor of `kind`, from whatever layout wrote them."""
    pieces = reader.pieces(t.name, kind)
    _check_shape(pieces, t, kind)
    same = [p for p in pieces if _same_place(p, t) and p["lo"] < hi and p["hi"] > lo]
    if same:   # dtype from a piece of this very range: 8-bit AdamW's states are uint8 or fp32 by fragment size
        out = torch.empty(hi - lo, dtype=reader.read(same[0], 0, 1).dtype)
        if _covered(same, lo, hi, out, reader) == hi - lo:
            return out
    return _target_tensor(reader, t, kind, pieces)[lo:hi].clone()
