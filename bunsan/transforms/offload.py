"""Activation offload (`activation_checkpointing.offload_blocks`): chosen blocks keep what they save for
backward in host memory, the way torch.autograd.graph.save_on_cpu does, but copied asynchronously.

Each block's forward runs under saved_tensors_hooks. A saved tensor's bytes (the part of its storage it
reaches, once per storage and version: the q, k and v matmuls save one normed input) go to pinned host memory
on a side stream, so the copy overlaps the forward's compute; the caching allocator is told the side stream
uses the device memory (record_stream), so it is not reused before the copy is done. In backward the bytes
come back on the compute stream, after it waits for that copy, without blocking the host. A tensor on the
CPU stays where it is (the offload is a no-op there). Parameters and constant inputs (rotary tables, masks)
are never copied: they stay on the device anyway.

With recompute the hooks sit outside the checkpoint, so what goes to host memory is what the recompute keeps:
the block input (mode full), and the block input only under selective (the outputs selective keeps live in
the checkpoint's own cache, on the device). Backward does not prefetch: a block's bytes come back when its
backward first needs them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from bunsan.transforms.checkpointing import transformer_blocks


class HostCopy:
    """The bytes of a stretch of one device storage in host memory (pinned on CUDA), and their way back."""

    def __init__(self, stretch: torch.Tensor, stream: torch.cuda.Stream | None):
        self.device, self.stream = stretch.device, stream
        self.host = torch.empty(stretch.numel(), dtype=torch.uint8, device="cpu", pin_memory=stretch.is_cuda)
        self.back: torch.Tensor | None = None      # on the device again (shared by the views saved from it)
        if stream is None:
            self.host.copy_(stretch)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))   # the tensor is written before it is read
        with torch.cuda.stream(stream):
            self.host.copy_(stretch, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        stretch.record_stream(stream)      # its memory is reused only after the copy

    def to_device(self) -> torch.Tensor:
        if self.back is None:
            if self.stream is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.back = self.host.to(self.device, non_blocking=self.stream is not None)
        return self.back


def stretch_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's storage from its first element to its last, as a flat uint8 tensor (a view)."""
    reach = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (reach,))
    return flat.view(torch.uint8)


class Offload:
    """The saved_tensors_hooks of one block: pack copies to host memory, unpack brings back."""

    def __init__(self, block: nn.Module, copy_cpu: bool = False):
        self.block = block
        self.copy_cpu = copy_cpu       # copy host tensors too (tests: the copy path without a GPU)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.copies: dict[tuple, HostCopy] = {}     # this forward's, by (storage, version, stretch)
        # The copied device bytes, held until the forward ends: a storage freed sooner could hand its
        # address to a new tensor, which the key above would take for the one copied.
        self.sources: list[torch.Tensor] = []
        self.kept: set[int] = set()                 # storages left where they are: parameters, constants
        self.host_bytes = 0                          # bytes the last forward put in host memory

    @contextlib.contextmanager
    def saving(self, inputs):
        """Offload what the forward saves, but not the parameters nor the constants among its `inputs` (rotary
        tables, masks): they stay on the device anyway."""
        self.copies, self.sources, self.host_bytes = {}, [], 0
        # here, not at apply time: ZeRO-3 gathers a block's parameters in its forward pre-hook
        constants = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and not t.requires_grad]
        self.kept = {t.untyped_storage().data_ptr() for t in [*self.block.parameters(), *constants]}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.copies, self.sources = {}, []      # the device tensors are the forward's again

    def stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    @torch.no_grad()
    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if not t.numel() or st.data_ptr() in self.kept or (t.device.type == "cpu" and not self.copy_cpu):
            return t
        stretch = stretch_of(t.detach())
        key = (st.data_ptr(), t._version, t.storage_offset() * t.element_size(), stretch.numel())
        copy = self.copies.get(key)
        if copy is None:      # the first view saved from these bytes in this forward
            copy = self.copies[key] = HostCopy(stretch, self.stream(t.device))
            self.sources.append(stretch)
            self.host_bytes += stretch.numel()
        return copy, t.dtype, t.shape, t.stride()

    @torch.no_grad()
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        copy, dtype, shape, stride = packed
        return copy.to_device().view(dtype).as_strided(shape, stride)


def offloaded_blocks(blocks: list[nn.Module], count: int | str) -> list[nn.Module]:
    """The first `count` blocks ("all": every one; more than there are: all of them)."""
    return list(blocks) if count == "all" else list(blocks)[:count]


def apply_activation_offload(model: nn.Module, count: int | str, copy_cpu: bool = False) -> list[Offload]:
    """Keep the saved activations of the model's first `count` blocks (or "all") in host memory. Apply it
    after recompute, so it wraps the checkpoint. Returns each block's Offload."""
    blocks = offloaded_blocks(transformer_blocks(model, "activation offload"), count)
    hooks = []
    for block in blocks:
        offload, inner = Offload(block, copy_cpu), block.forward

        def forward(*args, _inner=inner, _offload=offload, **kwargs):
            if not torch.is_grad_enabled():     # eval / generation: nothing is saved
                return _inner(*args, **kwargs)
            with _offload.saving((args, kwargs)):
                return _inner(*args, **kwargs)
        block.forward = forward
        hooks.append(offload)
    return hooks
