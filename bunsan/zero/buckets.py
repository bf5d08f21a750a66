"""Flat parameter/gradient buffers and bucketed gradient reduction launched from backward hooks.

    flat params  [ lm_head | norm | layer N-1 ... | layer 0 | embed ]   (reverse registration
    flat grads   [ bucket 0          | bucket 1   | ... | bucket k ]     = backward order)

Every trainable parameter's `.data` and `.grad` are views into two contiguous
buffers, laid out (by a ShardLayout) in reverse registration order, which
approximates the order in which backward produces gradients. autograd accumulates
into an existing `.grad` in place, so gradient accumulation writes straight into
the buffer and no second copy of the gradients exists (torch DDP keeps one in its
buckets).

A post-accumulate-grad hook counts down each bucket on the last micro-step; a
full bucket's collective (`launch(k)`) starts at once, async, so it overlaps the
rest of backward. Buckets launch strictly in order, so every rank issues the same
collectives in the same sequence; buckets whose parameters got no gradient are
launched by `finish()`. Averaging is SUM then a multiply (gloo has no AVG).

The hooks reach their BucketHooks through a weak reference. Python's garbage collector does not see what torch
holds for a post-accumulate-grad hook, so a hook that held its owner (and through it the parameters, the engine,
its process groups and shared-memory rings) would keep all of it alive after the engine was dropped; a program
that builds engines repeatedly would keep every one. When the BucketHooks goes, its hooks are removed.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from bunsan.zero.host_buffer import HostBuffer
from bunsan.zero.layout import ShardLayout


def check_one_dtype(params: list[nn.Parameter]) -> torch.dtype:
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"trainable parameters have several dtypes {sorted(map(str, dtypes))}; "
                         "bunsan keeps one dtype per model (cast the model, or set fp16/bf16 in the config)")
    return params[0].dtype


class FlatParams:
    """Parameters (and optionally gradients) of one dtype in flat buffers laid out by `layout`."""

    def __init__(self, params: list[nn.Parameter], layout: ShardLayout, with_grads: bool = True):
        self.params, self.layout = params, layout
        self.dtype = check_one_dtype(params)
        device = params[0].device
        self.numel = sum(p.numel() for p in params)
        self.data = torch.zeros(layout.total, dtype=self.dtype, device=device)
        self._grad_host = None
        if with_grads and device.type == "cpu":   # see zero_grad (stage 1 drops pages; stage 0 zeroes)
            self._grad_host = HostBuffer(layout.total, self.dtype)
            self.grad = self._grad_host.tensor
        else:
            self.grad = torch.zeros(layout.total, dtype=self.dtype, device=device) if with_grads else None
        with torch.no_grad():
            for i, p in enumerate(params):
                self.view(self.data, i).copy_(p.data)
        self.attach()

    def zero_grad(self) -> None:
        """Zero the gradients. On CPU the buffer's pages are dropped instead: they read as zeros and come
        back as backward writes them, so the gradients take no memory through forward, where activations
        peak (torch DDP keeps its bucket copy of them throughout)."""
        if self._grad_host is not None:
            self._grad_host.release()
        else:
            self.grad.zero_()

    def view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        p, off = self.params[i], self.layout.offsets[i]
        return buf[off:off + p.numel()].view_as(p)

    def attach(self) -> None:
        """(Re)point every parameter's data (and grad) at the flat buffers."""
        for i, p in enumerate(self.params):
            p.data = self.view(self.data, i)
            if self.grad is not None:
                p.grad = self.view(self.grad, i)

    def grads_attached(self) -> bool:
        return self.grad is None or all(
            p.grad is not None and p.grad.data_ptr() == self.view(self.grad, i).data_ptr()
            for i, p in enumerate(self.params))


class BucketHooks:
    """Counts gradients into buckets from backward hooks and calls `launch(k)` for each full bucket, in order."""

    def __init__(self, params: list[nn.Parameter], bucket_params: list[tuple[int, ...]], launch,
                 on_grad=None, every_micro_step: bool = False, overlap: bool = True):
        self.params, self.launch_fn, self.on_grad = params, launch, on_grad
        self.every_micro_step, self.overlap = every_micro_step, overlap
        self.bucket_of = [0] * len(params)
        for k, members in enumerate(bucket_params):
            for i in members:
                self.bucket_of[i] = k
        self.sizes = [len(m) for m in bucket_params]
        self.active = False      # set by begin(): this backward reduces
        self._pending: list[int] = []
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]
        weakref.finalize(self, _remove, self._hooks)

    def _make_hook(self, i: int):
        bucket, owner = self.bucket_of[i], weakref.ref(self)     # weak: see the module docstring

        def hook(param):
            hooks = owner()
            if hooks is None or not hooks.active:
                return
            if hooks.on_grad is not None:
                hooks.on_grad(i, param)
            if hooks.overlap:
                hooks._pending[bucket] -= 1
                hooks._launch_ready()
        return hook

    def begin(self) -> None:
        self.active = True
        self._pending = list(self.sizes)
        self._next = 0

    def _launch_ready(self) -> None:
        while self._next < len(self._pending) and self._pending[self._next] == 0:
            self.launch_fn(self._next)
            self._next += 1

    def finish(self) -> None:
        """Launch what backward left: buckets with unused parameters, or all of them without overlap."""
        while self._next < len(self.sizes):
            self.launch_fn(self._next)
            self._next += 1
        self.active = False

    def remove(self) -> None:
        _remove(self._hooks)


def _remove(handles) -> None:
    for h in handles:
        h.remove()
