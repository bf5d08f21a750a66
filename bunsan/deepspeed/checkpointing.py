"""`deepspeed.checkpointing`: activation checkpointing, `checkpoint(function, *args)` recomputing `function`'s
activations in backward (torch's non-reentrant checkpoint: it keeps each input and the RNG state, so dropout
draws the same mask again)."""

from __future__ import annotations

import torch.utils.checkpoint as torch_checkpoint

__all__ = ["configure", "checkpoint", "is_configured", "reset"]

_configured = False


def configure(mpu_=None, deepspeed_config=None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None):
    global _configured
    if mpu_ is not None:
        raise ValueError("checkpointing.configure(mpu_=...): bunsan has no Megatron mpu; pass None")
    refused = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
               "checkpoint_in_cpu": checkpoint_in_cpu}
    on = sorted(k for k, v in refused.items() if v)
    if on:
        raise ValueError(f"checkpointing.configure({', '.join(f'{k}=True' for k in on)}): not supported by bunsan; "
                         "its recompute keeps each checkpointed function's inputs on the device")
    _configured = True


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; bunsan keeps none."""


def checkpoint(function, *args):
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False)
