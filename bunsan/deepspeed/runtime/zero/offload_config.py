"""`deepspeed.runtime.zero.offload_config`: the enums DeepSpeed scripts pass to offload_states()."""

from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"                  # the optimizer's moments
    hp_params = "hp_params"                        # fp32 master weights
    lp_params = "lp_params"                        # the model's (16-bit) weights
    lp_grads = "lp_grads"                          # their gradients
    contiguous_grad_buffer = "contiguous_grad_buffer"
