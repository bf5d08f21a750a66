"""Activation bytes measured: what a forward leaves alive for its backward, however it is kept.

saved_tensors_hooks see what autograd saves, but not what selective checkpointing caches beside it (its
policy's kept outputs live in the checkpoint's own storage) nor what an offload hook moved elsewhere. This
counts storages instead: every storage an op makes while the forward runs is watched through a weak
reference, and those still alive when it returns (the forward's result aside) are what backward will use.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageWatch(TorchDispatchMode):
    """Weak references to the storages ops allocate (an output's storage that none of the op's inputs has: not
    a view, not written in place), with their sizes and devices."""

    def __init__(self):
        super().__init__()
        self.made: dict[StorageWeakRef, tuple[int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                ref = StorageWeakRef(st)
                if ref not in inputs:
                    self.made.setdefault(ref, (st.nbytes(), t.device.type))
        return out

    def alive(self, but: Any = None) -> dict[str, int]:
        """Bytes of the watched storages still alive, by device type, leaving out those of `but`'s tensors."""
        gc.collect()
        skip = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves(but) if isinstance(t, torch.Tensor)}
        held: dict[str, int] = {}
        for ref, (nbytes, device) in self.made.items():
            if not ref.expired() and ref not in skip:
                held[device] = held.get(device, 0) + nbytes
        return held


def held_for_backward(forward: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """(forward's result, bytes by device type of what it made and left alive besides the result)."""
    with StorageWatch() as watch:
        result = forward()
    return result, watch.alive(but=result)
