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

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks

from bunsan.comm import functional as world
from bunsan.comm.process_group import init_distributed
from bunsan.deepspeed.engine import engine_holding
from bunsan.deepspeed.zero_status import ZeroParamStatus, available
from bunsan.zero.slices import (agree, attach_rebuilders, gather, gather_device, keep_slice, parameter_slots,
                                refresh_owners, slice_of, swap_slots)

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus"]


def _slice_module(root: nn.Module) -> None:
    """Keep this rank's slice of every trainable parameter of `root`; frozen ones and buffers stay whole
    (rank 0's)."""
    with torch.no_grad():
        for slots in parameter_slots(root).values():
            p = getattr(*slots[0])
            agree(p)
            if p.requires_grad:
                keep_slice(slots, p.data)
        for b in root.buffers():
            if not b.is_meta:
                agree(b)
    attach_rebuilders(root)


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
    refresh_owners(sliced)
    slices = [slice_of(p) for p in sliced]
    before = [gather(s) for s in slices]
    whole = [swap_slots(s.owners, nn.Parameter(b.clone())) for s, b in zip(slices, before)]
    try:
        yield
    finally:
        changed = sum(not torch.equal(w.data, b) for w, b in zip(whole, before))
        if modifier_rank is None and world.get_world_size() > 1:   # every rank refuses, or none: no hang
            count = torch.tensor([float(changed)], device=gather_device())
            world.all_reduce(count, op=world.ReduceOp.MAX)
            changed = int(count.item())
        for p, s, w, b in zip(sliced, slices, whole, before):
            full = b if modifier_rank is None else w.data.clone()
            if modifier_rank is not None and world.get_world_size() > 1:
                moved = full.to(gather_device())
                world.broadcast(moved, modifier_rank)
                full = moved.to(full.device)
            for key, value in w.__dict__.items():   # attributes set on the whole parameter in the block stay
                setattr(p, key, value)
            # a slot given another parameter in the block keeps it, as with DeepSpeed (transformers'
            # resize_token_embeddings assigns the new embedding's weight there)
            keep_slice([(m, n) for m, n in s.owners if m._parameters.get(n) is w], full, reuse=p)
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
    # callers may pass a set turned into a list (transformers does): each rank's own order; gather in the
    # slices' creation order, which every rank shares
    sliced = sorted((p for p in params if slice_of(p) is not None), key=lambda p: slice_of(p).seq)
    engine = next((e for e in (engine_holding(p) for p in params) if e is not None), None)
    with contextlib.ExitStack() as stack:
        if sliced:
            stack.enter_context(_whole(sliced, modifier_rank))
        if engine is not None:
            stack.enter_context(engine.gathered_parameters(modifier_rank=modifier_rank))
            if engine.strategy.stage == 3:
                stack.enter_context(available(list(engine.module.parameters())))
        yield
