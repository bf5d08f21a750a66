"""`deepspeed.zero`: `Init` (build any module, keep only this rank's slice of each parameter) and
`GatheredParameters` (whole parameters for a while; with `modifier_rank`, that rank's writes kept everywhere).

DeepSpeed partitions each module's parameters the moment that module's `__init__` returns, so a parent that
re-initialises its children afterwards (`self.apply(self._init_weights)`, nanoGPT's and Hugging Face's
pattern) writes into empty partitions and the write is lost unless wrapped in GatheredParameters. bunsan
slices when the `with` block ends instead: every module is initialised by its own code, its parent's
re-initialisation included, exactly as without Init. The price is that the model exists whole once, in host
memory, while it is built; after the block each rank keeps 1/world of every parameter on the host, and
`initialize` with ZeRO-3 materialises one unit at a time on the device from those slices. A model that must
never exist whole anywhere is built with `bunsan.zero.Init()` and an `init_parameter(name, tensor, seed)`.

As DeepSpeed, rank 0's values are what every rank keeps (each rank may have drawn different numbers).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks

from bunsan.comm import functional as world
from bunsan.comm.process_group import init_distributed
from bunsan.deepspeed.engine import engine_holding

__all__ = ["Init", "GatheredParameters"]


@dataclass
class Slice:
    """This rank's piece of one parameter built under Init: elements [rank*chunk, rank*chunk + len(piece)).
    The parameter itself is a meta tensor; `owners` are the (module, name) slots that hold it (tied: several)."""
    piece: torch.Tensor       # on the host, flat
    shape: torch.Size
    chunk: int
    owners: list


_SLICED: dict[int, tuple[weakref.ref, Slice]] = {}   # id(parameter) -> (the parameter, its slice)
# (id(module), name) -> its slot's slice: to_empty() gives a meta parameter a new object, the slot stays
_SLOTS: dict[tuple[int, str], Slice] = {}


def slice_of(p: torch.Tensor) -> Slice | None:
    hit = _SLICED.get(id(p))
    return hit[1] if hit is not None and hit[0]() is p else None


def _gather_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if world.get_backend() == "nccl" \
        else torch.device("cpu")


def gather(s: Slice, device: torch.device | None = None) -> torch.Tensor:
    """The whole parameter from every rank's slice (collective over the world: every rank calls it)."""
    size = world.get_world_size()
    if size == 1:
        return s.piece.view(s.shape).clone()
    at = _gather_device()
    padded = torch.zeros(s.chunk, dtype=s.piece.dtype, device=at)
    padded[:s.piece.numel()] = s.piece
    out = torch.empty(size * s.chunk, dtype=s.piece.dtype, device=at)
    world.all_gather_into_tensor(out, padded)
    return out[:s.shape.numel()].view(s.shape).to(device or s.piece.device)


def _swap(owners: list, new: nn.Parameter) -> nn.Parameter:
    for module, name in owners:
        module._parameters[name] = new
    return new


def _keep_slice(owners: list, full: torch.Tensor) -> nn.Parameter:
    """Put a meta parameter in `owners`' slots, remembering this rank's slice of `full`."""
    size, rank = world.get_world_size(), world.get_rank()
    flat = full.detach().reshape(-1)
    chunk = math.ceil(flat.numel() / size)
    piece = flat[rank * chunk:(rank + 1) * chunk].to("cpu", copy=True)
    new = nn.Parameter(torch.empty(full.shape, dtype=full.dtype, device="meta"))
    kept = Slice(piece, full.shape, chunk, owners)
    _SLICED[id(new)] = (weakref.ref(new), kept)
    for module, name in owners:
        _SLOTS[(id(module), name)] = kept
    return _swap(owners, new)


def _agree(t: torch.Tensor) -> None:
    """Rank 0's values on every rank (through the backend's device)."""
    if world.get_world_size() == 1:
        return
    at = _gather_device()
    moved = t.detach().to(at)
    world.broadcast(moved, 0)
    t.data.copy_(moved)


def _slice_module(root: nn.Module) -> None:
    """Keep this rank's slice of every trainable parameter of `root`; frozen ones and buffers stay whole
    (rank 0's). `root` learns to rebuild them: init_parameter (ZeRO-3's unit-by-unit materialisation) and
    init_weights (every other layout)."""
    owners: dict[int, list] = {}
    for m in root.modules():
        for name, p in m._parameters.items():
            if p is not None and not p.is_meta:
                owners.setdefault(id(p), []).append((m, name))
    with torch.no_grad():
        for slots in owners.values():
            p = getattr(*slots[0])
            _agree(p)
            if p.requires_grad:
                _keep_slice(slots, p.data)
        for b in root.buffers():
            if not b.is_meta:
                _agree(b)
    buffers = {name: b.detach().clone() for name, b in root.named_buffers()}

    def init_parameter(name: str, tensor: torch.Tensor, seed: int = 0) -> None:
        path, _, attr = name.rpartition(".")
        s = _SLOTS.get((id(root.get_submodule(path)), attr))
        if s is None:
            raise ValueError(f"parameter {name!r} was not built under zero.Init, so there is no slice to rebuild "
                             "it from; build the whole model inside the `with zero.Init():` block")
        tensor.copy_(gather(s, tensor.device))

    def init_weights(seed: int | None = None) -> None:   # after to_empty(): every parameter and buffer
        with torch.no_grad():
            for name, p in root.named_parameters():
                init_parameter(name, p.data)
            for name, b in root.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])

    root.init_parameter, root.init_weights = init_parameter, init_weights


class Init:
    """`with deepspeed.zero.Init(): model = Net()`; or `zero.Init(module=model)` for a model already built."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype=None, mpu=None, **unsupported):
        if unsupported:
            raise TypeError(f"zero.Init got {sorted(unsupported)}, which bunsan does not support; it takes module, "
                            "remote_device ('cpu'), pin_memory, config_dict_or_path, enabled, dtype")
        if data_parallel_group is not None or mpu is not None:
            raise ValueError("zero.Init(data_parallel_group=/mpu=): bunsan slices over the whole world here and "
                             "re-shards for the mesh at initialize; drop the argument")
        if remote_device not in (None, "cpu", "none"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): bunsan keeps the slices in host memory "
                             "('cpu'); NVMe parameter offload is zero_optimization.offload_param in the config")
        self.enabled = enabled
        self._made: dict[int, nn.Module] = {}  # modules that got parameters or children inside the block
        self._children: set[int] = set()
        self._handles: list = []
        if module is not None and enabled:
            init_distributed()
            _slice_module(module)

    def __enter__(self):
        if not self.enabled:
            return self
        init_distributed()

        def on_parameter(module, name, param):
            self._made.setdefault(id(module), module)   # (dicts keep creation order)

        def on_child(module, name, child):
            on_parameter(module, name, None)
            if child is not None:
                self._children.add(id(child))

        self._handles = [module_hooks.register_module_parameter_registration_hook(on_parameter),
                         module_hooks.register_module_module_registration_hook(on_child)]
        return self

    def __exit__(self, exc_type, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        if exc_type is not None or not self.enabled:
            return False
        for root in self._made.values():   # creation order: the same on every rank
            if id(root) not in self._children:
                _slice_module(root)
        self._made, self._children = {}, set()
        return False


def _as_list(params) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None]


@contextlib.contextmanager
def _whole(sliced: list[nn.Parameter], modifier_rank: int | None):
    """Parameters sliced by Init made whole (real parameters in their modules' slots for the block); on exit
    the modifier's values are sliced again, or a write without a modifier is refused."""
    slices = [slice_of(p) for p in sliced]
    before = [gather(s) for s in slices]
    whole = [_swap(s.owners, nn.Parameter(b.clone())) for s, b in zip(slices, before)]
    try:
        yield
    finally:
        changed = sum(not torch.equal(w.data, b) for w, b in zip(whole, before))
        if modifier_rank is None and world.get_world_size() > 1:   # every rank refuses, or none: no hang
            count = torch.tensor([float(changed)], device=_gather_device())
            world.all_reduce(count, op=world.ReduceOp.MAX)
            changed = int(count.item())
        for s, w, b in zip(slices, whole, before):
            full = b if modifier_rank is None else w.data.clone()
            if modifier_rank is not None and world.get_world_size() > 1:
                moved = full.to(_gather_device())
                world.broadcast(moved, modifier_rank)
                full = moved.to(full.device)
            _keep_slice(s.owners, full)
        if modifier_rank is None and changed:
            raise RuntimeError(f"{changed} parameter(s) built under zero.Init were changed inside "
                               "GatheredParameters without a modifier_rank, and would be lost: pass "
                               "modifier_rank=R to keep what rank R writes, on every rank")


@contextlib.contextmanager
def GatheredParameters(params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
    """Whole values of `params` inside the block (a collective: every rank enters it). Parameters sliced by
    Init and parameters of an engine are gathered; any other parameter is already whole and is left as it is,
    as in DeepSpeed. With `modifier_rank` what that rank writes is kept on every rank; without, a write is an
    error (DeepSpeed would drop it silently)."""
    if fwd_module is not None:
        raise ValueError("GatheredParameters(fwd_module=...) registers external parameters for a forward "
                         "pass; bunsan gathers a ZeRO-3 unit's parameters itself: drop the argument")
    params = _as_list(params) if enabled else []
    sliced = [p for p in params if slice_of(p) is not None]
    engine = next((e for e in (engine_holding(p) for p in params) if e is not None), None)
    with contextlib.ExitStack() as stack:
        if sliced:
            stack.enter_context(_whole(sliced, modifier_rank))
        if engine is not None:
            stack.enter_context(engine.gathered_parameters(modifier_rank=modifier_rank))
        yield
