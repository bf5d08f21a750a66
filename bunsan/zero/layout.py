"""Shard math for ZeRO: buckets padded to N equal slices, and which slice of which parameter a rank owns.

Parameters are laid end to end in buckets (stages 1-2: runs of `reduce_bucket_size`
elements in backward order; stage 3: one bucket per unit, e.g. a transformer block).
Each bucket is padded to a multiple of N and cut into N equal slices; rank r owns
slice r of every bucket. Its *shard* is those slices end to end:

    bucket 0: [ r0 | r1 ]        bucket 1: [ r0 | r1 ]   (| = slice boundary, padding at the end)
    shard of rank 0 = bucket0.r0 ++ bucket1.r0

Reduce-scatter and all-gather then work bucket by bucket on contiguous memory, and
every shard element knows its global position (bucket start + rank offset), which
is what a checkpoint needs to reshard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

ALIGN = 16  # elements; keeps slices aligned for vectorised kernels and fp16/bf16 storage


@dataclass(frozen=True)
class Fragment:
    """The part of parameter `param` (index into the layout's params) that lies in this rank's shard."""

    param: int
    param_offset: int   # first element within the flattened parameter
    shard_offset: int   # first element within the rank's shard
    flat_offset: int    # first element within the flat (all-buckets) buffer
    numel: int


@dataclass(frozen=True)
class Bucket:
    start: int          # in the flat buffer
    size: int           # padded, a multiple of N
    params: tuple[int, ...]

    def slice_of(self, rank: int, n: int) -> tuple[int, int]:
        length = self.size // n
        return self.start + rank * length, self.start + (rank + 1) * length


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class ShardLayout:
    """Where every parameter sits in the flat buffer, the buckets, and this rank's fragments."""

    def __init__(self, params: list[nn.Parameter], groups: list[list[int]], n: int, rank: int, align: int = ALIGN):
        """`groups` lists parameter indices per bucket, in order; each bucket is padded to n x align."""
        self.n, self.rank = n, rank
        self.numels = [p.numel() for p in params]
        self.offsets = [0] * len(params)
        self.buckets: list[Bucket] = []
        start = 0
        for members in groups:
            off = start
            for i in members:
                self.offsets[i] = off
                off += self.numels[i]
            size = _round_up(off - start, n * align)
            self.buckets.append(Bucket(start, size, tuple(members)))
            start += size
        self.total = start
        self.shard_numel = self.total // n
        self.fragments = self._fragments()

    def _fragments(self) -> list[Fragment]:
        frags, shard_off = [], 0
        for b in self.buckets:
            lo, hi = b.slice_of(self.rank, self.n)
            for i in b.params:
                p_lo, p_hi = self.offsets[i], self.offsets[i] + self.numels[i]
                a, z = max(lo, p_lo), min(hi, p_hi)
                if a < z:
                    frags.append(Fragment(i, a - p_lo, shard_off + (a - lo), a, z - a))
            shard_off += hi - lo
        return frags

    def shard_slices(self) -> list[tuple[int, int, int]]:
        """(flat start, flat end, shard start) of this rank's slice of every bucket."""
        out, shard_off = [], 0
        for b in self.buckets:
            lo, hi = b.slice_of(self.rank, self.n)
            out.append((lo, hi, shard_off))
            shard_off += hi - lo
        return out

    @staticmethod
    def greedy_buckets(numels: list[int], bucket_elems: int) -> list[list[int]]:
        """Consecutive parameters grouped into buckets of at least `bucket_elems` elements (the last may be less)."""
        groups, cur, size = [], [], 0
        for i, k in enumerate(numels):
            cur.append(i)
            size += k
            if size >= bucket_elems:
                groups.append(cur)
                cur, size = [], 0
        if cur:
            groups.append(cur)
        return groups
