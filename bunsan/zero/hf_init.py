"""`bunsan.zero.Init` for Hugging Face models: each rank keeps only its slice of every parameter, and the
values are a normal build's for the same seed.

A normal build draws from the CPU generator in an order set by nested `post_init` calls: the constructors of
the inner model's modules (torch's default init of each Linear and Embedding), that model's `init_weights`
(HF's `_init_weights`, children first), then the outer model's own modules and its `init_weights`, and
finally the tie of the output embedding (whose drawn values are thrown away). On the meta device the
constructors and `init_weights` draw nothing, so Init records the random ops and the `init_weights` calls in
order and replays them afterwards: a constructor's draw into a scratch tensor that is thrown away (only the
generator's position matters: `_init_weights` overwrites it), an `init_weights` as HF's own children-first
walk, one block (`_no_split_modules`) at a time: the block is materialised on the host, initialised, and
sliced before the next, so the host holds one block (or one embedding) whole at most.

What this cannot reproduce is an error naming it, never a silent difference: a parameter or buffer that
`_init_weights` leaves at its constructor's value (the meta device has none), a write into a parameter that is
already sliced, a random op with its own generator.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from bunsan.comm.process_group import init_distributed
from bunsan.models.blocks import repeated_blocks
from bunsan.zero.slices import agree, attach_rebuilders, keep_slice, parameter_slots, slice_of

__all__ = ["HFReplay"]

FALLBACK = ("build it under bunsan.deepspeed.zero.Init() instead (built whole on the host by the model's own "
            "code, then sliced)")


def _spec(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, torch.device) and x.type == "meta":
        return torch.device("cpu")
    return x


def _real(x):
    if isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor":
        return torch.empty_strided(x[1], x[2], dtype=x[3])
    return x


@dataclass
class Draw:
    """A random op run during construction, as specs: replayed on scratch host tensors. `before`/`after`: the
    host generator's state around it in the meta build (they differ for a real host tensor's draw)."""
    func: object
    args: tuple
    kwargs: dict
    before: torch.Tensor
    after: torch.Tensor

    def replay(self) -> None:
        self.func(*[_real(a) for a in self.args], **{k: _real(v) for k, v in self.kwargs.items()})


@dataclass
class InitCall:
    """A model's `init_weights` during construction. `tied`: target slot -> source slot for each tie it made
    (a normal build draws into the target's own tensor first, and the tie drops it)."""
    model: nn.Module
    tied: dict
    before: torch.Tensor
    after: torch.Tensor


class Recorder(TorchDispatchMode):
    """Every host-generator random op, in order (CUDA ops draw from CUDA's generator, the same in both builds)."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            device = kwargs.get("device")
            on_host = all(t.device.type in ("meta", "cpu") for t in tensors) and \
                (device is None or torch.device(device).type in ("meta", "cpu"))
            if on_host:
                if kwargs.get("generator") is not None:
                    raise ValueError(f"a random op with its own generator ({func}) ran while a Hugging Face model "
                                     "was built under bunsan.zero.Init, and cannot be replayed; " + FALLBACK)
                before = torch.get_rng_state()
                out = func(*args, **kwargs)
                self.events.append(Draw(func, tuple(_spec(a) for a in args),
                                        {k: _spec(v) for k, v in kwargs.items()}, before, torch.get_rng_state()))
                return out
        return func(*args, **kwargs)


class WriteWatch(TorchDispatchMode):
    """Which host storages were written during the walk; a write into a meta tensor (a slice) is an error."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self.root, self.written = root, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema.arguments
        values = list(zip(schema, args)) + [(a, kwargs[a.name]) for a in schema if a.name in kwargs]
        for arg, value in values:
            if isinstance(value, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write:
                if value.is_meta:
                    base = value._base if value._base is not None else value
                    name = next((n for n, p in self.root.named_parameters(remove_duplicate=False) if p is base),
                                f"a {tuple(base.shape)} tensor")
                    raise ValueError(f"the model's _init_weights wrote into {name} after its block was sliced "
                                     "(a module initialising another block's parameters); bunsan.zero.Init "
                                     "cannot replay that: " + FALLBACK)
                self.written.add(value.untyped_storage().data_ptr())
        return func(*args, **kwargs)


class HFReplay:
    """Records while the Init block runs (`__enter__`/`__exit__` around the build), replays at `finish()`."""

    def __init__(self):
        self.events: list = []
        self.patched = None
        self.recorder = Recorder(self.events)

    def __enter__(self):
        self.rng = torch.get_rng_state()
        if "transformers" in sys.modules:     # (transformers loads modeling_utils lazily: load it now)
            import transformers.modeling_utils as modeling

            init_distributed()        # each rank keeps its slice of the world's
            agree(self.rng)           # rank 0's numbers on every rank, as DeepSpeed keeps rank 0's values
            torch.set_rng_state(self.rng)

            pretrained = modeling.PreTrainedModel
            original = pretrained.init_weights
            events = self.events

            def recorded_init_weights(model):
                before = {(m, n): p for m in model.modules() for n, p in m._parameters.items()}
                state = torch.get_rng_state()
                original(model)
                tied = {}
                for (m, n), p in before.items():
                    now = m._parameters[n]
                    source = next((slot for slot, q in before.items() if q is now), None) if now is not p else None
                    if source is not None:
                        tied[(id(m), n)] = source
                events.append(InitCall(model, tied, state, torch.get_rng_state()))

            pretrained.init_weights = recorded_init_weights
            self.patched = (pretrained, original)
        self.recorder.__enter__()
        return self

    def __exit__(self, *exc):
        self.recorder.__exit__(*exc)
        if self.patched is not None:
            self.patched[0].init_weights = self.patched[1]
        return False

    def finish(self) -> list[nn.Module]:
        """Replay the draws and initialise the models built in the block; the outermost models, sliced."""
        calls = [e for e in self.events if isinstance(e, InitCall)]
        if not calls:
            return []
        models = [c.model for c in calls]
        roots = [m for m in models if not any(m is not o and any(m is x for x in o.modules()) for o in models)]
        exit_state = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        meta_state = self.rng         # where the meta build's generator stood
        walkers = {id(r): Walker(r) for r in roots}
        for e in self.events:
            if not torch.equal(e.before, meta_state):   # seeded inside the block: a normal build is there too
                torch.set_rng_state(e.before)
            if isinstance(e, Draw):
                e.replay()
            else:
                root = next(r for r in roots if any(e.model is x for x in r.modules()))
                walkers[id(root)].initialise(e)
            meta_state = e.after
        if not torch.equal(exit_state, meta_state):
            torch.set_rng_state(exit_state)
        for root in roots:
            walkers[id(root)].check_done()
            attach_rebuilders(root)
        return roots


class Walker:
    """HF's `initialize_weights` walk over one root model, a block at a time, slicing as blocks finish."""

    def __init__(self, root: nn.Module):
        self.root = root
        # id(parameter) -> (the parameter, its slots): holding it keeps the id from being reused
        self.slots = {i: (getattr(*slots[0]), slots) for i, slots in parameter_slots(root, include_meta=True).items()}
        self.prefix = {id(m): f"{p}." if p else "" for p, m in root.named_modules(remove_duplicate=False)}
        self.block_of: dict[int, nn.Module] = {}
        for block in repeated_blocks(root):
            for m in block.modules():
                self.block_of.setdefault(id(m), block)
        self.materialised: list[tuple[nn.Module, str, str]] = []   # (module, name, "param"/"buffer")

    def initialise(self, call: InitCall) -> None:
        modeling = sys.modules["transformers.modeling_utils"]
        guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
        if not hasattr(call.model, "_initialize_weights"):
            raise ValueError(f"{type(call.model).__name__} has no _initialize_weights (transformers "
                             f"{sys.modules['transformers'].__version__}); bunsan.zero.Init replays HF's own "
                             "initialisation from transformers 4.45 on: " + FALLBACK)
        self.watch = WriteWatch(self.root)
        with torch.no_grad(), (guard() if guard else contextlib.nullcontext()), self.watch:
            self.walk(call.model, call.model._initialize_weights, call, modeling.PreTrainedModel)

    def walk(self, module: nn.Module, fn, call: InitCall, pretrained: type) -> None:
        for child in module.children():
            self.walk(child, child._initialize_weights if isinstance(child, pretrained) else fn, call, pretrained)
        if getattr(module, "_is_hf_initialized", False):
            return
        block = self.block_of.get(id(module))
        tied = [name for name in module._parameters if (id(module), name) in call.tied]
        for name in tied:    # a stand-in to draw into: a normal build drew into the target's own tensor
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype))
        self.materialise(block if block is not None else module, recurse=block is not None)
        try:
            if hasattr(call.model, "is_custom_code"):     # transformers 5: (module, is_custom_code)
                fn(module, call.model.is_custom_code())
            else:
                fn(module)
        finally:
            for name in tied:
                source, source_name = call.tied[(id(module), name)]
                module._parameters[name] = source._parameters[source_name]
        if block is None or block is module:
            self.slice_finished()

    def materialise(self, module: nn.Module, recurse: bool) -> None:
        """Real, empty host tensors for the meta ones that were never initialised (not slices)."""
        for m in (module.modules() if recurse else [module]):
            for p in list(m._parameters.values()):
                if p is not None and p.is_meta and slice_of(p) is None:
                    self.replace(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
            for name, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
                    self.materialised.append((m, name, "buffer"))
                    self.watch.written.discard(m._buffers[name].untyped_storage().data_ptr())

    def replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        _, slots = self.slots.pop(id(old))
        for m, name in slots:
            if m._parameters[name] is old:     # (a tie target holds a stand-in while it is visited)
                m._parameters[name] = new
        self.slots[id(new)] = (new, slots)
        self.materialised.append((slots[0][0], slots[0][1], "param"))
        self.watch.written.discard(new.untyped_storage().data_ptr())

    def slice_finished(self) -> None:
        for module, name, kind in self.materialised:
            t = (module._parameters if kind == "param" else module._buffers)[name]
            if t.untyped_storage().data_ptr() not in self.watch.written:
                raise ValueError(f"{self.prefix[id(module)]}{name} is not written by the model's _init_weights, so a "
                                 "normal build keeps its constructor's value, which the meta device never had; "
                                 + FALLBACK)
            if kind == "param" and t.requires_grad:
                keep_slice(self.slots.pop(id(t))[1], t.data)
        self.materialised = []

    def check_done(self) -> None:
        left = [n for n, p in self.root.named_parameters() if p.is_meta and slice_of(p) is None]
        left += [n for n, b in self.root.named_buffers() if b.is_meta]
        if left:
            raise ValueError(f"{left[:3]} of {type(self.root).__name__} were never initialised by its "
                             "init_weights; " + FALLBACK)
