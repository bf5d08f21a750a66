"""DeepSpeed's ZeRO-3 parameter attributes (`ds_id`, `ds_status`, `ds_shape`, `ds_numel`) on an engine's model,
and the status they report (`deepspeed.runtime.zero.partition_parameters.ZeroParamStatus`)."""

from __future__ import annotations

import contextlib
from enum import Enum

import torch
import torch.nn as nn

__all__ = ["ZeroParamStatus", "available", "tag_parameters"]


class ZeroParamStatus(Enum):
    """DeepSpeed's `param.ds_status` (deepspeed.runtime.zero.partition_parameters re-exports it)."""
    AVAILABLE = 1        # whole on this rank (inside GatheredParameters)
    NOT_AVAILABLE = 2    # only this rank's shard is held
    INFLIGHT = 3         # being gathered


def tag_parameters(module: nn.Module) -> None:
    """DeepSpeed's ZeRO-3 attributes on every parameter of an engine's model: scripts test `hasattr(p, "ds_id")`
    and `p.ds_status` to pick what to gather, and read `ds_shape` / `ds_numel` for the whole size. Without
    them such a script would read a released parameter's empty storage as its value."""
    for i, p in enumerate(module.parameters()):
        p.ds_id, p.ds_shape, p.ds_numel = i, tuple(p.shape), p.numel()
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


@contextlib.contextmanager
def available(params: list[torch.Tensor]):
    tagged = [p for p in params if hasattr(p, "ds_status")]
    for p in tagged:
        p.ds_status = ZeroParamStatus.AVAILABLE
    try:
        yield
    finally:
        for p in tagged:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
