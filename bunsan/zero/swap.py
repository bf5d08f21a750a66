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
    def __init__(self, directory: str | os.PathLike, name: str):
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

    def read(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        off, size = self.regions[key]
        buf = np.empty(size, dtype=np.uint8)
        view, done = memoryview(buf), 0
        while done < size:
            n = os.preadv(self.fd, [view[done:]], off + done)
            if n == 0:
                raise IOError(f"swap file {self.path} ended early reading {key}")
            done += n
        self.bytes_read += size
        return torch.from_numpy(buf).view(dtype)[:numel]

    def size(self) -> int:
        return sum(s for _, s in self.regions.values())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)
