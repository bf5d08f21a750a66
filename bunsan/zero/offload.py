"""Moving ZeRO's offloaded states between the GPU and pinned host memory without stalling the GPU's stream.

With `offload_optimizer: cpu` the fp32 gradient shard lives on the host, where the optimizer steps. Each
reduced bucket's shard slice must get there: a plain `dst.add_(out.to("cpu"))` inside a backward hook copies
synchronously, so the host waits for the GPU at every bucket and the next layers' backward is not launched
meanwhile. Here a bucket's slice is copied into a pinned staging buffer on a side stream (after the reduction,
which the compute stream has waited for), an event marks the copy, and the host adds it into the shard only
when a later bucket needs the staging room, or at the end of backward: by then the copy is long done.

    compute stream:  ... reduce k ... backward of the next layers ...
    copy stream:               \\-> copy k to pinned -> event k
    host:                                      (bucket k + DEPTH) wait event k, add k into the fp32 shard

On the CPU (no device) the add happens at once: host and device are one, so there is no copy to overlap.
"""

from __future__ import annotations

from collections import deque

import torch

DEPTH = 4        # bucket slices in flight to the host before the oldest is added


class HostAdds:
    """`add(src on the device, dst fp32 on the host)`: dst += src, copied on a side stream; `drain()` finishes
    all (call at the end of backward, before the shard is read)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._flight: deque = deque()           # (event, staging buffer, dst)
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=True)

    def add(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.stream is None or src.device.type == "cpu":
            dst.add_(src.to(dst.device, torch.float32))
            return
        buf = self._staging(src.numel(), src.dtype)
        self.stream.wait_stream(torch.cuda.current_stream(src.device))   # after the reduction that made src
        with torch.cuda.stream(self.stream):
            buf.copy_(src.reshape(-1), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)       # src's memory is not reused before the copy has read it
        self._flight.append((done, buf, dst))
        if len(self._flight) > DEPTH:
            self._finish_one()

    def _finish_one(self) -> None:
        done, buf, dst = self._flight.popleft()
        done.synchronize()                   # long complete by now: DEPTH buckets were reduced since
        dst.add_(buf.view_as(dst).to(torch.float32))
        self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)

    def drain(self) -> None:
        while self._flight:
            self._finish_one()


class CopyMarks:
    """Events after host->device copies of host memory that the host writes again later (ZeRO-3's offloaded,
    pinned parameter shards: a prefetch's copy is asynchronous), so a write waits for the copy that reads the
    same memory. Without a device, nothing to wait for."""

    def __init__(self, device: torch.device):
        self.on_device = device.type == "cuda"
        self._marks: dict[int, torch.cuda.Event] = {}

    def copied(self, key: int) -> None:
        if self.on_device:
            mark = torch.cuda.Event()
            mark.record()
            self._marks[key] = mark

    def before_write(self, key: int) -> None:
        mark = self._marks.pop(key, None)
        if mark is not None:
            mark.synchronize()
