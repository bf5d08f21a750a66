"""Building ZeRO-3 shards one unit at a time, including models that exist only on the meta device.

A model built under `bunsan.zero.Init()` has meta parameters. Each unit is
materialised whole, briefly, on the device (`model.init_parameter(name, tensor,
seed)` fills each tensor by name, so every rank draws the same numbers), the rank
keeps its slice, and the unit is freed: no rank ever holds more than its shard
plus one unit.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from bunsan.zero.slices import gather, slice_of


def unit_full_weights(module: nn.Module, layout, k: int, params: list, names: list[str], dtype: torch.dtype,
                      device: torch.device, seed: int, meta: bool) -> torch.Tensor:
    """Bucket k's parameters (one unit's) laid out as the (padded) bucket, on the device."""
    b = layout.buckets[k]
    full = torch.zeros(b.size, dtype=dtype, device=device)
    init = getattr(module, "init_parameter", None)
    with torch.no_grad():
        for i in b.params:
            p = params[i]
            off = layout.offsets[i] - b.start
            view = full[off:off + p.numel()].view(p.shape)
            if not (meta and p.is_meta):
                view.copy_(p.data)
            elif (piece := slice_of(p)) is not None:   # sliced by deepspeed.zero.Init, wherever it sits in the model
                view.copy_(gather(piece, device))
            elif init is not None:
                tmp = torch.empty(p.shape, dtype=torch.float32, device=device)
                init(names[i], tmp, seed)
                view.copy_(tmp)
            else:
                raise ValueError(f"{names[i]} of {type(module).__name__} is on the meta device (bunsan.zero.Init) "
                                 "but the model has no init_parameter(name, tensor, seed) method to initialise it "
                                 "shard by shard; add one, or build it under bunsan.deepspeed.zero.Init() (any "
                                 "module: built once in host memory by its own init, then each rank keeps its "
                                 "slice); a transformers model under bunsan.zero.Init is initialised by its own "
                                 "_init_weights when transformers is imported before the block")
    return full


def replace_meta_parameters(module: nn.Module, params: list[nn.Parameter], device: torch.device,
                            dtype: torch.dtype) -> list[nn.Parameter]:
    """Swap meta parameters for real (empty) ones everywhere they are referenced (tied weights stay tied).

    Meta buffers are allocated on the device and recomputed by `module.init_buffers()` when it exists.
    """
    new = {p: nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
           for p in params}
    meta_buffers = [n for n, b in module.named_buffers() if b.is_meta]
    if meta_buffers and not hasattr(module, "init_buffers"):   # (a rotary inv_freq left empty: garbage)
        raise ValueError(f"{type(module).__name__} was built on the meta device with buffers {meta_buffers[:3]} "
                         "but has no init_buffers() to compute them; add one, or build the model under "
                         "bunsan.deepspeed.zero.Init (built whole on the host, then sliced)")
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p in new:
                m._parameters[name] = new[p]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    if hasattr(module, "init_buffers"):
        module.init_buffers()
    return [new[p] for p in params]
