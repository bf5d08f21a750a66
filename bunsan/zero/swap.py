"""A scratch file on fast local disk (NVMe) holding named tensors: the back store of ZeRO-Infinity-style offload.

Regions are allocated on first write and reused afterwards; reads and writes are
plain positional I/O (os.pread/os.pwrite) of the tensor bytes, so nothing is
pickled and only the tensor being used is in memory. The file is removed when
the process exits.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import numpy as np
import torch


class SwapFile:
    def __init__(self, directory: str | os.PathLike, name: str, pinned_buffers: int = 0):
        """pinned_buffers > 0 (offload_param.pin_memory with buffer_count on a GPU): reads land in that many
        pinned host buffers, used in turn, so the host-to-device copy of what was read runs asynchronously;
        the caller says `copied()` after enqueueing it, and a buffer is refilled only after its copy ran."""
        d = Path(directory)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"nvme_path '{d}' cannot be created ({e}); point offload_*.nvme_path at a writable "
                          "directory on a local disk") from e
        self.path = d / f"bunsan-{name}-{os.getpid()}.swap"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.regions: dict[str, tuple[int, int]] = {}
        self.end = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._pinned: list[torch.Tensor | None] = [None] * pinned_buffers
        self._marks: list = [None] * pinned_buffers
        self._turn = -1
        atexit.register(self.close)

    def write(self, key: str, t: torch.Tensor) -> None:
        data = t.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        off, size = self.regions.get(key, (None, None))
        if off is None or size != data.nbytes:
            off, size = self.end, data.nbytes
            self.regions[key] = (off, size)
            self.end += (size + 4095) // 4096 * 4096  # page-aligned regions
        done = 0
        while done < size:
            done += os.pwrite(self.fd, memoryview(data)[done:], off + done)
        self.bytes_written += size

    def _buffer(self, size: int) -> torch.Tensor:
        """Where a read lands: fresh memory, or the next pinned buffer once its last copy has run."""
        if not self._pinned:
            return torch.from_numpy(np.empty(size, dtype=np.uint8))
        self._turn = (self._turn + 1) % len(self._pinned)
        if self._marks[self._turn] is not None:
            self._marks[self._turn].synchronize()
            self._marks[self._turn] = None
        pinned = self._pinned[self._turn]
        if pinned is None or pinned.numel() < size:
            pinned = self._pinned[self._turn] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return pinned[:size]

    def copied(self) -> None:
        """The last read's buffer is being copied to the device (on the current stream): refill it after."""
        if self._pinned and self._turn >= 0:
            mark = torch.cuda.Event()
            mark.record()
            self._marks[self._turn] = mark

    def read(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        off, size = self.regions[key]
        buf = self._buffer(size)
        view, done = memoryview(buf.numpy()), 0
        while done < size:
            n = os.preadv(self.fd, [view[done:]], off + done)
            if n == 0:
                raise IOError(f"swap file {self.path} ended early reading {key}")
            done += n
        self.bytes_read += size
        return buf.view(dtype)[:numel]

    def size(self) -> int:
        return sum(s for _, s in self.regions.values())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)
