"""Gradient reduce-scatter into this rank's fp32 shard, bucket by bucket (ZeRO stages 1-3).

Stage 1 hands in slices of its full flat gradient buffer. Stages 2-3 hand in a
staging bucket that `stage_grad` fills as autograd produces each parameter's
gradient (which is then freed); at most IN_FLIGHT buckets are being reduced at
once, which bounds the full-size gradient memory to that many buckets.
"""

from __future__ import annotations

import torch

from .host_buffer import HostPool, trim_heap
from .layout import ShardLayout

IN_FLIGHT = 2


class ShardReducer:
    def __init__(self, layout: ShardLayout, comm, group, dtype: torch.dtype, opt, zero_cfg,
                 source=None, after_launch=None, trim_every: int = 0):
        """source(k) -> the bucket's full gradient (stage 1); default: the staging bucket (stages 2-3)."""
        self.layout, self.comm, self.group, self.dtype, self.opt = layout, comm, group, dtype, opt
        self.use_reduce_scatter = zero_cfg.reduce_scatter
        self.source = source or self._pop_staging
        self.after_launch = after_launch
        self.slices = layout.shard_slices()
        self.bucket_of = [0] * len(layout.numels)
        for k, b in enumerate(layout.buckets):
            for i in b.params:
                self.bucket_of[i] = k
        self._staging: dict[int, torch.Tensor] = {}
        self._flight: list = []
        self.device = None
        self.pool = HostPool() if source is None else None   # staging and outputs on CPU (see host_buffer)
        self.trim_every, self._completed = trim_every, 0      # heap trims during backward (host_buffer.py)

    def _zeros(self, numel: int, device) -> torch.Tensor:
        if self.pool is not None and torch.device(device).type == "cpu":
            return self.pool.take(numel, self.dtype)
        return torch.zeros(numel, dtype=self.dtype, device=device)

    def _give(self, t: torch.Tensor) -> None:
        if self.pool is not None and t.device.type == "cpu":
            self.pool.give(t)

    def stage_grad(self, i: int, param) -> None:
        """Copy parameter i's fresh gradient into its bucket and free it."""
        k = self.bucket_of[i]
        b = self.layout.buckets[k]
        buf = self._staging.get(k)
        if buf is None:
            buf = self._staging[k] = self._zeros(b.size, param.grad.device)
        off = self.layout.offsets[i] - b.start
        buf[off:off + param.numel()].copy_(param.grad.reshape(-1))
        param.grad = None

    def _pop_staging(self, k: int) -> torch.Tensor:
        full = self._staging.pop(k, None)
        if full is None:  # no parameter of this bucket got a gradient: still take part in the collective
            full = self._zeros(self.layout.buckets[k].size, self.device)
        return full

    def launch(self, k: int) -> None:
        full = self.source(k)
        if self.use_reduce_scatter:
            out = self._zeros(full.numel() // self.group.size, full.device)
            handle = self.comm.reduce_scatter(out, full, self.group, async_op=True)
        else:  # DeepSpeed's reduce_scatter: false -> all-reduce and keep the slice
            handle, out = self.comm.all_reduce(full, self.group, async_op=True), None
        self._flight.append((k, handle, out, full))
        if self.after_launch is not None:
            self.after_launch(k)
        if len(self._flight) > IN_FLIGHT:
            self._complete(self._flight.pop(0))

    def _complete(self, item) -> None:
        k, handle, out, full = item
        handle.wait()
        lo, hi, s = self.slices[k]
        if out is None:
            start = self.layout.buckets[k].start
            out = full[lo - start:hi - start]
        self.opt.ensure_grad()   # made at the first reduce, once the loss's large gradients are gone
        dst = self.opt.grad[s:s + hi - lo]
        dst.add_(out.to(dst.device, torch.float32))
        self._give(full)
        if out is not full and self.use_reduce_scatter:
            self._give(out)
        self._completed += 1
        if self.trim_every and self._completed % self.trim_every == 0:
            trim_heap()

    def drain(self) -> None:
        for item in self._flight:
            self._complete(item)
        self._flight = []
