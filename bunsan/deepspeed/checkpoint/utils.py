"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: a state dict's tensors as their own compact copies
on `device` (a view of a flat buffer saved as is would carry the whole buffer)."""

from __future__ import annotations

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
