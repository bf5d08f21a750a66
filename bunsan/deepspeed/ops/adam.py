"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam compute Adam / AdamW; bunsan builds torch's.

With `adam_w_mode=True` (their default) the weight decay is decoupled (torch.optim.AdamW), otherwise it is
L2 added to the gradient (torch.optim.Adam); `bias_correction=False` builds bunsan's UncorrectedAdam. bunsan's strategies step torch optimizers on shards and
offloaded masters themselves, so DeepSpeed's kernels have no job here.
"""

from __future__ import annotations

import torch

from bunsan.optim.deepspeed_optimizers import UncorrectedAdam

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def FusedAdam(params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,  # noqa: N802
              adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
    if not bias_correction:
        if amsgrad:
            raise ValueError("FusedAdam(bias_correction=False, amsgrad=True) is not built; drop one of them")
        return UncorrectedAdam(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                               decoupled_weight_decay=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


def DeepSpeedCPUAdam(model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),  # noqa: N802
                     eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                     fp32_optimizer_states: bool = True):
    if not fp32_optimizer_states:
        raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False): bunsan keeps optimizer states in fp32")
    return FusedAdam(model_params, lr, bias_correction, betas, eps, adamw_mode, weight_decay, amsgrad)
