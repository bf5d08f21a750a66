"""Flat parameter/gradient buffers and bucketed gradient all-reduce from backward hooks.

    flat params  [ lm_head | norm | layer N-1 ... | layer 0 | embed ]   (reverse registration
    flat grads   [ bucket 0          | bucket 1   | ... | bucket k ]     = backward order)

Every trainable parameter's `.data` and `.grad` are views into two contiguous
buffers, laid out in reverse registration order, which approximates the order in
which backward produces gradients. autograd accumulates into an existing `.grad`
in place, so gradient accumulation writes straight into the buffer and no second
copy of the gradients exists (torch DDP keeps one in its buckets).

A post-accumulate-grad hook counts down each bucket on the last micro-step; a
full bucket's all-reduce is launched at once (async) so it overlaps the rest of
backward. Buckets launch strictly in order, so every rank issues the same
collectives in the same sequence; buckets whose parameters got no gradient are
launched by `finish()`. Averaging is SUM then a multiply (gloo has no AVG).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .comm import Comm, Group


class FlatParams:
    """Parameters and gradients of one dtype in two flat buffers, cut into reduce buckets."""

    def __init__(self, params: list[nn.Parameter], bucket_elems: int):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; "
                             "bunsan keeps one dtype per model (cast the model, or set fp16/bf16 in the config)")
        self.params = list(reversed(params))
        self.dtype = params[0].dtype
        device = params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.data = torch.empty(self.numel, dtype=self.dtype, device=device)
        self.grad = torch.zeros(self.numel, dtype=self.dtype, device=device)
        self.offsets: list[int] = []
        off = 0
        with torch.no_grad():
            for p in self.params:
                self.offsets.append(off)
                self.data[off:off + p.numel()].copy_(p.data.reshape(-1))
                off += p.numel()
        self.attach()
        # Buckets: contiguous ranges that close once they hold at least bucket_elems elements.
        self.buckets: list[tuple[int, int]] = []
        self.bucket_of: list[int] = []
        start = 0
        for i, p in enumerate(self.params):
            self.bucket_of.append(len(self.buckets))
            end = self.offsets[i] + p.numel()
            if end - start >= bucket_elems or i == len(self.params) - 1:
                self.buckets.append((start, end))
                start = end
        self.bucket_sizes = [sum(1 for b in self.bucket_of if b == k) for k in range(len(self.buckets))]

    def view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return buf[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def attach(self) -> None:
        """(Re)point every parameter's data and grad at the flat buffers."""
        for i, p in enumerate(self.params):
            p.data = self.view(self.data, i)
            p.grad = self.view(self.grad, i)

    def grads_attached(self) -> bool:
        return all(p.grad is not None and p.grad.data_ptr() == self.view(self.grad, i).data_ptr()
                   for i, p in enumerate(self.params))


class GradSync:
    """Launches bucket all-reduces from backward hooks and waits for them in `finish()`."""

    def __init__(self, flat: FlatParams, comm: Comm, group: Group, overlap: bool = True):
        self.flat, self.comm, self.group, self.overlap = flat, comm, group, overlap
        self.sync_now = False  # set by the engine on the last micro-step of an optimizer step
        self._pending: list[int] = []
        self._next = 0
        self._handles: list = []
        self._hooks = []
        if group.size > 1:
            for i, p in enumerate(flat.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _make_hook(self, i: int):
        bucket = self.flat.bucket_of[i]

        def hook(_param):
            if not self.sync_now or not self.overlap:
                return
            self._pending[bucket] -= 1
            self._launch_ready()
        return hook

    def begin(self) -> None:
        """Arm the hooks for a synchronising backward."""
        self._pending = list(self.flat.bucket_sizes)
        self._next = 0
        self._handles = []

    def _launch(self, k: int) -> None:
        start, end = self.flat.buckets[k]
        self._handles.append(self.comm.all_reduce(self.flat.grad[start:end], self.group, async_op=True))

    def _launch_ready(self) -> None:
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def finish(self) -> None:
        """Launch what backward left (unused parameters, overlap off) and wait for everything."""
        if self.group.size > 1:
            while self._next < len(self.flat.buckets):
                self._launch(self._next)
                self._next += 1
            for h in self._handles:
                h.wait()
        self._handles = []

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
