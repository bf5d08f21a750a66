"""A rank's training states moved off the device between uses and back (DeepSpeed's offload_states /
reload_states), by storage: each storage's bytes are copied to host memory and the device storage is
resized to 0 bytes, as FSDP frees a unit. Every view of a storage (the parameters in a flat buffer, a master
aliased to it, the sub-optimizers' parameters, `.grad` views) stays the same object and sees the values again
after reload; nothing that holds a reference has to be found and rewritten.

A parked storage must not be touched: kernels do not check a storage's size, so reading one would read
freed memory. The engine refuses to run while states are parked (deepspeed/engine.py).
"""

from __future__ import annotations

import torch

__all__ = ["KINDS", "state_tensors", "Parked", "park"]

# DeepSpeed's OffloadStateTypeEnum values
KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


def state_tensors(strategy) -> dict[str, list[torch.Tensor]]:
    """The tensors of each kind a data-parallel strategy (zero/stage0.py, stage12.py, stage3.py) holds."""
    opt = getattr(strategy, "opt", None)       # stages 1-3: the sharded optimizer
    optimizers = [sg.optimizer for sg in opt.subgroups] if opt is not None else [strategy.optimizer]
    out = {kind: [] for kind in KINDS}
    out["optim_states"] = [v for o in optimizers for s in o.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor)]
    master = opt.master if opt is not None else strategy.master
    out["hp_params"] = [master] if master is not None else []
    flat = getattr(strategy, "flat", None)     # stages 0-2: the whole flat parameters (and stage 0-1 gradients)
    if flat is not None:
        out["lp_params"] = [flat.data]
        out["lp_grads"] = [flat.grad] if flat.grad is not None else []
    else:                                      # stage 3: the parameter shards, frozen (LoRA base) ones too
        out["lp_params"] = [strategy.param_shard] if strategy.param_shard is not None else []
        if strategy.frozen_shards is not None:
            out["lp_params"].append(strategy.frozen_shards.shard)
    if opt is not None and opt.grad is not None:   # the fp32 gradient shard (from the first reduce to the step)
        out["contiguous_grad_buffer"] = [opt.grad]
    return out


class Parked:
    """Storages emptied on the device, each with its bytes on the host."""

    def __init__(self, device: torch.device):
        self.device = device
        self.storages: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.kept: list[tuple[str, int]] = []     # (kind, bytes) of storages that cannot be resized

    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.storages)

    def reload(self, non_blocking: bool = False) -> None:
        for storage, host in self.storages:
            storage.resize_(host.numel())
            _bytes_of(storage, self.device).copy_(host, non_blocking=non_blocking)
        self.storages = []


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def park(strategy, include, device: torch.device, pin_memory: bool = True, non_blocking: bool = False) -> Parked:
    """Move the states of the kinds in `include` (None: all) that live on `device` to host memory."""
    kinds = list(KINDS) if include is None else [getattr(k, "value", k) for k in include]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"offload_states(include={unknown}): the kinds of state are {list(KINDS)} "
                         "(OffloadStateTypeEnum)")
    if device.type == "cuda" and device.index is None:     # (tensors say cuda:N; the engine's may say cuda)
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = state_tensors(strategy)
    parked, seen = Parked(device), set()
    pin = pin_memory and device.type == "cuda"
    with torch.no_grad():
        for kind in kinds:
            for t in tensors[kind]:
                storage = t.untyped_storage()
                if t.device != device or storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue          # elsewhere already (offloaded, on the host), empty, or shared with one parked
                if not storage.resizable():   # a host mapping (host_buffer.py): CPU runs only, where nothing moves
                    parked.kept.append((kind, storage.nbytes()))
                    continue
                seen.add(storage.data_ptr())
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes_of(storage, device), non_blocking=non_blocking and pin)
                parked.storages.append((storage, host))
        # (a non-blocking copy may still be reading a storage freed here: the caching allocator hands its block
        # to later work of the same stream only, which runs after the copy; so does reload's copy back)
        for storage, _ in parked.storages:
            storage.resize_(0)
    return parked
