"""Host memory that goes back to the OS: page-dropping buffers at a fixed address, and heap trimming.

A stage-3 unit is gathered and released twice per step. Through glibc's malloc a
released unit leaves a hole in the heap that activations then split, so resident
memory creeps far above what the process holds. A private anonymous mapping
instead is dropped with madvise(DONTNEED): the
pages leave at once, the address and the tensor (and every view autograd saved)
stay valid, and the next gather faults fresh zero pages back in.

Smaller tensors (activations, gradients) still come from the heap, where glibc keeps
freed chunks resident; `trim_heap()` hands their pages back at the points where
ZeRO has just freed something (after a step, after a few released units or buckets).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np
import torch


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

# Released ZeRO-3 units, or reduced buckets at stages 1-2, between heap trims. Each block leaves about
# its activation size in freed heap chunks that glibc keeps resident; trimming after every few bounds
# that to a few blocks' worth, and pays fewer page faults than trimming after each one.
TRIM_EVERY = 4


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the OS (glibc's malloc_trim; no-op elsewhere)."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class HostBuffer:
    def __init__(self, numel: int, dtype: torch.dtype):
        nbytes = max(numel * dtype.itemsize, 1)
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8, count=numel * dtype.itemsize)
                                       ).view(dtype)

    def release(self) -> None:
        """Drop the pages (reads see zeros until written again)."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of this buffer now in RAM (mincore), to check that a release really gave pages back."""
        page = mmap.PAGESIZE
        pages = (len(self._map) + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(self.tensor.data_ptr()), ctypes.c_size_t(len(self._map)), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec) * page


class HostPool:
    """Reused host buffers for per-step transients (gradient buckets, reduce outputs): a buffer handed
    back drops its pages, so it costs no memory until taken again, and reads as zeros when it is. A buffer
    given with keep=True stays resident instead, for `reuse` (stale contents, no page faults), until
    `release_kept` drops it like the others."""

    def __init__(self):
        self._free: dict[tuple[int, torch.dtype], list[HostBuffer]] = {}
        self._kept: dict[tuple[int, torch.dtype], list[HostBuffer]] = {}
        self._owner: dict[int, HostBuffer] = {}

    def _lend(self, buf: HostBuffer) -> torch.Tensor:
        self._owner[id(buf.tensor)] = buf
        return buf.tensor

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of numel elements."""
        free = self._free.get((numel, dtype))
        return self._lend(free.pop() if free else HostBuffer(numel, dtype))

    def reuse(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A kept (resident) tensor of numel elements, holding whatever it held; None if there is none."""
        kept = self._kept.get((numel, dtype))
        return self._lend(kept.pop()) if kept else None

    def give(self, t: torch.Tensor, keep: bool = False) -> None:
        buf = self._owner.pop(id(t))
        if keep:
            self._kept.setdefault((t.numel(), t.dtype), []).append(buf)
            return
        buf.release()
        self._free.setdefault((t.numel(), t.dtype), []).append(buf)

    def release_kept(self) -> None:
        """Drop the pages of every kept buffer (they read as zeros when taken again)."""
        for key, kept in self._kept.items():
            for buf in kept:
                buf.release()
            self._free.setdefault(key, []).extend(kept)
        self._kept = {}
