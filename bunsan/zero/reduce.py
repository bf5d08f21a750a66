"""Gradient reduce-scatter into this rank's fp32 shard, bucket by bucket (ZeRO stages 1-3).

Stage 1 hands in slices of its full flat gradient buffer. Stages 2-3 hand in a
staging bucket that `stage_grad` fills as autograd produces each parameter's
gradient (which is then freed); at most IN_FLIGHT buckets are being reduced at
once, which bounds the full-size gradient memory to that many buckets.

A bucket's first reduce since the shard was made (stage 1's only one, the first
micro-step's in stages 2-3) lands straight in its slice of the fp32 shard when
the dtypes and devices match: no output buffer to fault in and no add to run.

Within one backward a reduced bucket's staging and output buffers stay resident in the pool
and are reused as they are for later buckets; only the slots no gradient wrote and the
padding are zeroed.
Taking each bucket from the pool as fresh zero pages instead would fault in the whole model's
gradient size every step. When backward ends their pages are dropped, so forward never holds them.
"""

from __future__ import annotations

import torch

from bunsan.zero.host_buffer import HostPool, trim_heap
from bunsan.zero.layout import ShardLayout
from bunsan.zero.offload import HostAdds

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
        self._dirty: dict[int, set[int]] = {}     # staged in a reused buffer: bucket -> parameters written so far
        self._flight: list = []
        self._written: set[int] = set()     # buckets whose shard slice holds a reduce since the shard was made
        self.device = None
        self._host_adds: HostAdds | None = None   # slices bound for a shard in host memory (offload_optimizer)
        self.pool = HostPool() if source is None else None   # staging and outputs on CPU (see host_buffer)
        self.trim_every, self._completed = trim_every, 0      # heap trims during backward (host_buffer.py)

    def _zeros(self, numel: int, device) -> torch.Tensor:
        if self.pool is not None and torch.device(device).type == "cpu":
            return self.pool.take(numel, self.dtype)
        return torch.zeros(numel, dtype=self.dtype, device=device)

    def _give(self, t: torch.Tensor) -> None:
        """Hand a host buffer back, resident for reuse until backward ends (drain releases it)."""
        if self.pool is not None and t.device.type == "cpu":
            self.pool.give(t, keep=True)

    def _reuse(self, numel: int, device) -> torch.Tensor | None:
        """A host buffer reduced earlier in this backward, holding stale values; None if there is none."""
        if self.pool is None or torch.device(device).type != "cpu":
            return None
        return self.pool.reuse(numel, self.dtype)

    def stage_grad(self, i: int, param) -> None:
        """Copy parameter i's fresh gradient into its bucket and free it."""
        k = self.bucket_of[i]
        b = self.layout.buckets[k]
        buf = self._staging.get(k)
        if buf is None:
            buf = self._reuse(b.size, param.grad.device)
            if buf is None:
                buf = self._zeros(b.size, param.grad.device)
            else:
                self._dirty[k] = set()
            self._staging[k] = buf
        off = self.layout.offsets[i] - b.start
        buf[off:off + param.numel()].copy_(param.grad.reshape(-1))
        if k in self._dirty:
            self._dirty[k].add(i)
        param.grad = None

    def _pop_staging(self, k: int) -> torch.Tensor:
        full = self._staging.pop(k, None)
        if full is None:  # no parameter of this bucket got a gradient: still take part in the collective
            return self._zeros(self.layout.buckets[k].size, self.device)
        written = self._dirty.pop(k, None)
        if written is not None:   # a reused buffer: zero what this backward did not write
            b = self.layout.buckets[k]
            end = 0
            for i in b.params:
                off = self.layout.offsets[i] - b.start
                if i not in written:
                    full[off:off + self.layout.numels[i]].zero_()
                end = max(end, off + self.layout.numels[i])
            full[end:].zero_()
        return full

    def _shard_slice(self, k: int) -> torch.Tensor:
        if self.opt.grad is None:    # made at the first reduce, once the loss's large gradients are gone
            self.opt.ensure_grad()
            self._written = set()
        lo, hi, s = self.slices[k]
        return self.opt.grad[s:s + hi - lo]

    def launch(self, k: int, full: torch.Tensor | None = None) -> None:
        """Reduce bucket k: its gradient from `source`, or `full` (a caller's buffer, never pooled)."""
        borrowed = full is not None
        full = self.source(k) if full is None else full
        direct = False
        if self.use_reduce_scatter:
            dst = self._shard_slice(k)
            direct = (k not in self._written and dst.dtype == full.dtype and dst.device == full.device
                      and dst.numel() * self.group.size == full.numel())
            if direct:
                out = dst
            else:   # every element is overwritten by the reduce-scatter: a stale spare will do
                out = self._reuse(full.numel() // self.group.size, full.device)
                if out is None:
                    out = self._zeros(full.numel() // self.group.size, full.device)
            handle = self.comm.reduce_scatter(out, full, self.group, async_op=True)
        else:  # DeepSpeed's reduce_scatter: false -> all-reduce and keep the slice
            handle, out = self.comm.all_reduce(full, self.group, async_op=True), None
        self._written.add(k)
        self._flight.append((k, handle, out, full, direct, borrowed))
        if self.after_launch is not None:
            self.after_launch(k)
        if len(self._flight) > IN_FLIGHT:
            self._complete(self._flight.pop(0))

    def _complete(self, item) -> None:
        k, handle, out, full, direct, borrowed = item
        handle.wait()
        if not direct:
            lo, hi, s = self.slices[k]
            if out is None:
                start = self.layout.buckets[k].start
                out = full[lo - start:hi - start]
            dst = self._shard_slice(k)
            if dst.device != out.device:    # the shard is offloaded: copied over asynchronously (offload.py)
                if self._host_adds is None:
                    self._host_adds = HostAdds(out.device)
                self._host_adds.add(out, dst)
            else:
                dst.add_(out.to(torch.float32))
            if self.use_reduce_scatter:
                self._give(out)
        if not borrowed:
            self._give(full)
        self._completed += 1
        if self.trim_every and self._completed % self.trim_every == 0:
            trim_heap()

    def drain(self) -> None:
        for item in self._flight:
            self._complete(item)
        self._flight = []
        if self._host_adds is not None:
            self._host_adds.drain()
        if self.pool is not None:
            self.pool.release_kept()
