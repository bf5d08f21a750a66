"""Parameters kept as this rank's slice until ZeRO-3 needs them whole: what both `zero.Init`s leave behind.

A sliced parameter is a meta tensor in its module (a SlicedParameter: it reports the device it is made whole
on, as DeepSpeed's partitioned parameters do); the rank's elements [rank*chunk, rank*chunk + len(piece))
of the flat parameter live on the host. The model learns `init_parameter(name, tensor, seed)` (ZeRO-3's
unit-by-unit materialisation gathers one parameter from every rank's slice) and `init_weights()` (every other
layout, after `to_empty()`).
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.comm import functional as world

__all__ = ["Slice", "SlicedParameter", "slice_of", "gather", "gather_device", "swap_slots", "keep_slice", "agree",
           "parameter_slots", "refresh_owners", "attach_rebuilders"]


@dataclass
class Slice:
    """This rank's piece of one parameter: elements [rank*chunk, rank*chunk + len(piece)). The parameter itself
    is a meta tensor; `owners` are the (module, name) slots that hold it (tied: several)."""
    piece: torch.Tensor       # on the host, flat
    shape: torch.Size
    chunk: int
    owners: list
    seq: int = 0              # creation order, the same on every rank: the order collectives gather slices in


class SlicedParameter(nn.Parameter):
    """The whole-shaped meta tensor standing in a module for a sliced parameter. Its `device` is where the
    values are made whole (the accelerator, else the host), and moving it there is a no-op: user code that
    builds beside a weight, `torch.zeros(..., device=weight.device)` or DeepSpeed-Chat's
    `LinearLayer_LoRA(weight).to(weight.device)`, gets real tensors, as with DeepSpeed's empty partitions,
    not meta ones whose values are gone. A dtype cast stays on meta (the slice is cast when gathered)."""

    @property
    def device(self) -> torch.device:
        return self.__dict__.get("_home") or torch.device("cpu")

    def to(self, *args, **kwargs):
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        return self if dtype is None or dtype == self.dtype else torch.Tensor.to(self, dtype=dtype)

    def cuda(self, *args, **kwargs):
        return self

    def cpu(self):
        return self


def _home() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


_SEQ = itertools.count()
SLICED: dict[int, tuple[weakref.ref, Slice]] = {}   # id(parameter) -> (the parameter, its slice)
# (id(module), name) -> its slot's slice: to_empty() gives a meta parameter a new object, the slot stays
SLOTS: dict[tuple[int, str], Slice] = {}
ROOTS: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()   # the models holding slices (attach_rebuilders)


def slice_of(p: torch.Tensor) -> Slice | None:
    hit = SLICED.get(id(p))
    return hit[1] if hit is not None and hit[0]() is p else None


def gather_device() -> torch.device:
    """Where collectives run: NCCL takes only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if world.get_backend() == "nccl" \
        else torch.device("cpu")


def gather(s: Slice, device: torch.device | None = None) -> torch.Tensor:
    """The whole parameter from every rank's slice (collective over the world: every rank calls it)."""
    size = world.get_world_size()
    if size == 1:
        return s.piece.view(s.shape).clone()
    at = gather_device()
    padded = torch.zeros(s.chunk, dtype=s.piece.dtype, device=at)
    padded[:s.piece.numel()] = s.piece
    out = torch.empty(size * s.chunk, dtype=s.piece.dtype, device=at)
    world.all_gather_into_tensor(out, padded)
    return out[:s.shape.numel()].view(s.shape).to(device or s.piece.device)


def swap_slots(owners: list, new: nn.Parameter) -> nn.Parameter:
    for module, name in owners:
        module._parameters[name] = new
    return new


def keep_slice(owners: list, full: torch.Tensor, reuse: nn.Parameter | None = None) -> nn.Parameter:
    """Put a meta parameter in `owners`' slots, remembering this rank's slice of `full`. `reuse`: the meta
    parameter that held the slice before (after a gather): the same object goes back, with the attributes code
    set on it (transformers marks loaded weights `_is_hf_initialized` and tests the mark afterwards)."""
    size, rank = world.get_world_size(), world.get_rank()
    flat = full.detach().reshape(-1)
    chunk = math.ceil(flat.numel() / size)
    piece = flat[rank * chunk:(rank + 1) * chunk].to("cpu", copy=True)
    new = reuse if reuse is not None and reuse.is_meta and reuse.shape == full.shape and reuse.dtype == full.dtype \
        else SlicedParameter(torch.empty(full.shape, dtype=full.dtype, device="meta"))
    new._home = _home()
    kept = Slice(piece, full.shape, chunk, owners, next(_SEQ))
    SLICED[id(new)] = (weakref.ref(new), kept)
    for module, name in owners:
        SLOTS[(id(module), name)] = kept
    return swap_slots(owners, new)


def agree(t: torch.Tensor) -> None:
    """Rank 0's values on every rank (through the backend's device)."""
    if world.get_world_size() == 1:
        return
    moved = t.detach().to(gather_device())
    world.broadcast(moved, 0)
    t.data.copy_(moved)


def parameter_slots(root: nn.Module, include_meta: bool = False) -> dict[int, list]:
    """id(parameter) -> every (module, name) slot holding it (a tied parameter has several), in module order."""
    owners: dict[int, list] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is not None and (include_meta or not p.is_meta):
                owners.setdefault(id(p), []).append((m, name))
    return owners


def refresh_owners(params: list[nn.Parameter]) -> None:
    """Add to each sliced parameter's owners the slots that took it after it was sliced: transformers ties
    the output embedding once the model is built, and reads the weight through that slot later."""
    wanted = {id(p): p for p in params}
    for root in list(ROOTS):
        for m in root.modules():
            for name, q in m._parameters.items():
                if q is not None and id(q) in wanted:
                    s = slice_of(q)
                    if not any(o is m and n == name for o, n in s.owners):
                        s.owners.append((m, name))
                        SLOTS[(id(m), name)] = s


def attach_rebuilders(root: nn.Module) -> None:
    """Give `root` init_parameter (ZeRO-3's unit-by-unit materialisation) and init_weights (every other layout,
    after to_empty()): sliced parameters gathered, buffers as they are now."""
    ROOTS.add(root)
    buffers = {name: b.detach().clone() for name, b in root.named_buffers() if not b.is_meta}

    def init_parameter(name: str, tensor: torch.Tensor, seed: int = 0) -> None:
        path, _, attr = name.rpartition(".")
        s = SLOTS.get((id(root.get_submodule(path)), attr))
        if s is None:
            raise ValueError(f"parameter {name!r} is on the meta device with no slice to rebuild it from: it was "
                             "not built under zero.Init but moved to the meta device afterwards (for instance "
                             "with `.to(weight.data.device)`: a sliced weight's data is a meta tensor), so its "
                             "values are gone; build it on a real device (`weight.device` is one), or inside the "
                             "`with zero.Init():` block")
        tensor.copy_(gather(s, tensor.device))

    def init_weights(seed: int | None = None) -> None:   # after to_empty(): every parameter and buffer
        with torch.no_grad():
            for name, p in root.named_parameters():
                init_parameter(name, p.data)
            for name, b in root.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])

    root.init_parameter, root.init_weights = init_parameter, init_weights
