"""How an optimizer's step reads its tensors, and so where it may step: one table for every class bunsan knows.

ZeRO stages 1-3 step each rank's fragments of the parameters (flat runs that cut rows anywhere), tensor
parallelism steps each rank's slice of a weight, and 16-bit training steps fp32 masters instead of the
model's parameters. Which of these give the same numbers as stepping the whole tensor depends on the update:

    elementwise   each element from its own gradient and states, and per-tensor scalars that follow from
                  the step count alone (torch's SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam,
                  Adadelta, ASGD, Rprop): any fragment steps as the whole would
    blockwise     elementwise with states quantised in blocks of each tensor (bitsandbytes' 8-bit AdamW):
                  a fragment's states differ from the whole tensor's in the block scales only
    factored      row and column statistics of each matrix (torch's Adafactor): ZeRO gathers them
                  (zero/adafactor.py); a tensor-parallel slice would have its own rows and columns
    whole         each matrix as one (torch's Muon orthogonalises it): whole tensors only, so ZeRO stage 0
                  without tensor parallelism
    refused       LBFGS re-evaluates the loss inside step(closure); SparseAdam needs sparse gradients

A user's optimizer is rebuilt over the tensors bunsan steps with its own class, groups and hyperparameters
(`rebuild`). A class bunsan does not know is refused where its update would be cut, unless its author
declares how it steps (`declare`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Stepping:
    kind: str                                   # elementwise | blockwise | factored | whole | refused
    state_bytes: Callable[[dict], float]        # fp32-equivalent state bytes per element, from hyperparameters
    why: str = ""                               # for `refused` and `whole`: what the update needs


def _n(*keys: str, base: float = 0.0) -> Callable[[dict], float]:
    """4 bytes of state per element for `base / 4` states plus one per hyperparameter that is set."""
    return lambda h: base + 4.0 * sum(1 for k in keys if h.get(k))


_BY_NAME: dict[str, Stepping] = {
    "SGD": Stepping("elementwise", _n("momentum")),
    "Adam": Stepping("elementwise", _n("amsgrad", base=8.0)),
    "AdamW": Stepping("elementwise", _n("amsgrad", base=8.0)),
    "RMSprop": Stepping("elementwise", _n("momentum", "centered", base=4.0)),
    "Adagrad": Stepping("elementwise", _n(base=4.0)),
    "Adamax": Stepping("elementwise", _n(base=8.0)),
    "NAdam": Stepping("elementwise", _n(base=8.0)),
    "RAdam": Stepping("elementwise", _n(base=8.0)),
    "Adadelta": Stepping("elementwise", _n(base=8.0)),
    "ASGD": Stepping("elementwise", _n(base=4.0)),
    "Rprop": Stepping("elementwise", _n(base=8.0)),
    # two 1-byte moments plus an fp32 absmax per block of 256 each
    "AdamW8bit": Stepping("blockwise", lambda h: 2.0 + 8.0 / 256),
    "Adafactor": Stepping("factored", lambda h: 0.0, "its row and column moments span whole rows and columns "
                          "of each matrix"),   # shape-dependent: memory/theory.adafactor_state_bytes
    "Muon": Stepping("whole", _n(base=4.0), "it orthogonalises each weight matrix as a whole (Newton-Schulz)"),
    # DeepSpeed's (optim/deepspeed_optimizers.py)
    "UncorrectedAdam": Stepping("elementwise", _n(base=8.0)),
    "Lamb": Stepping("whole", _n(base=8.0), "its trust ratio is the norm of each whole weight and of its whole "
                     "update"),
    **{name: Stepping("whole", _n(base=8.0 + extra), "it averages its own 1-bit compressed momentum over the "
                      "data-parallel ranks in place of the gradient all-reduce, which ZeRO stage 0 lets it do")
       for name, extra in (("OneBitAdam", 0.0), ("ZeroOneAdam", 4.0), ("OneBitLamb", 4.0))},
    "LBFGS": Stepping("refused", lambda h: 0.0, "it re-evaluates the loss several times inside step(closure) and "
                      "keeps a history over all parameters as one vector; bunsan's engine steps once per batch"),
    "SparseAdam": Stepping("refused", lambda h: 8.0, "it needs sparse gradients (nn.Embedding(sparse=True)) and "
                           "bunsan reduces dense gradient buckets"),
}
# where each known name lives: a torch name matches torch's class only (bitsandbytes' AdamW with optim_bits=8
# is not torch's AdamW), bitsandbytes' names its classes only
_HOME = {name: ("bitsandbytes.optim" if name == "AdamW8bit" else "torch.optim") for name in _BY_NAME}
_HOME |= {"UncorrectedAdam": "bunsan.optim.deepspeed_optimizers", "Lamb": "bunsan.optim.deepspeed_optimizers",
          **{name: "bunsan.optim.onebit" for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")}}
_declared: dict[type, Stepping] = {}


def declare(cls: type, kind: str = "elementwise", state_bytes_per_element: float = 0.0) -> type:
    """Tell bunsan how an optimizer class of your own steps, so that ZeRO may cut its parameters:
    `bunsan.optim.declare(Lion, "elementwise", state_bytes_per_element=4)`. Declare `elementwise` only when
    every element's update reads nothing but its own gradient, its own states and per-tensor scalars that
    follow from the step count: then a fragment steps as the whole tensor would. Returns cls (a decorator)."""
    if kind not in ("elementwise", "whole"):
        raise ValueError(f"bunsan.optim.declare({cls.__name__}, kind={kind!r}): kind must be 'elementwise' "
                         "(any fragment steps as the whole tensor) or 'whole' (whole tensors only)")
    _declared[cls] = Stepping(kind, lambda h: float(state_bytes_per_element),
                              "it is declared to step whole tensors only" if kind == "whole" else "")
    return cls


def stepping_of(cls: type) -> Stepping | None:
    """How `cls` steps: declared, or a known class (or a subclass that keeps its step()); None when unknown."""
    if cls in _declared:
        return _declared[cls]
    for base in cls.__mro__:
        known = _BY_NAME.get(base.__name__)
        if known is not None and base.__module__.startswith(_HOME[base.__name__]):
            # a subclass that writes its own step() could update anything any way
            return known if getattr(cls, "step", None) is getattr(base, "step", None) else None
    return None


def state_bytes_per_param(name: str, hyper: dict | None = None) -> float:
    """Optimizer-state bytes per parameter of the class named `name` (0 when unknown or factored)."""
    known = _BY_NAME.get(name)
    if known is None:
        known = next((s for c, s in _declared.items() if c.__name__ == name), None)
    if known is None:
        known = next((s for n, s in _BY_NAME.items() if n.lower() == name.lower()), None)
    return known.state_bytes(hyper or {}) if known else 0.0


def check_where(cls: type, zero_stage: int, tensor_parallel: bool) -> None:
    """Refuse an optimizer whose update would be cut by the layout, naming why and what runs it."""
    s = stepping_of(cls)
    name = cls.__name__
    if s is not None and s.kind == "refused":
        raise ValueError(f"{name} cannot train under bunsan: {s.why}; use an elementwise optimizer "
                         "(AdamW, SGD, ...)")
    cut = [what for what, on in (("zero_optimization.stage 1-3 give each rank fragments of the parameters",
                                  zero_stage >= 1),
                                 ("tensor parallelism gives each rank a slice of each weight", tensor_parallel))
           if on]
    if not cut:
        return
    if s is None:
        raise ValueError(
            f"{name} ({cls.__module__}) is not an optimizer bunsan knows: {' and '.join(cut)}, which gives the "
            "same update as the whole tensor only for an elementwise optimizer. If every element's update reads "
            f"only its own gradient, its own states and the step count, call bunsan.optim.declare({name}, "
            "'elementwise', state_bytes_per_element=...) before initialize; otherwise use "
            "zero_optimization.stage 0 without tensor parallelism")
    if s.kind == "whole" or (s.kind == "factored" and tensor_parallel):
        raise ValueError(f"{name} cannot step here: {s.why}, and {' and '.join(cut)}; use "
                         "zero_optimization.stage 0" + (" and tensor_parallel.size 1" if tensor_parallel else "") +
                         ", or an elementwise optimizer")


# -- a user's optimizer, rebuilt -----------------------------------------------------------------------
def has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer holds state from a step (Adagrad makes its state, with step 0, when built)."""
    for state in optimizer.state.values():
        if not state:
            continue
        step = state.get("step")
        if step is None or float(step) != 0.0:
            return True
    return False


def refuse_stepped(optimizer: torch.optim.Optimizer) -> None:
    if has_stepped(optimizer):
        raise ValueError(f"the {type(optimizer).__name__} passed to bunsan.initialize has already stepped (it holds "
                         "optimizer state); pass a freshly built optimizer and load state with "
                         "engine.load_checkpoint after initialize")


def constructor_keywords(cls: type, defaults: dict) -> dict:
    """The optimizer's defaults its constructor takes (torch 2.13's AdamW keeps `decoupled_weight_decay` in
    its defaults, which AdamW() refuses); a constructor with **kwargs takes them all."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params and k not in ("self", "params")}


CARRIED = ("args", "is_paged")      # bitsandbytes' settings outside `defaults` (carried_keywords)


def carried_keywords(optimizer: torch.optim.Optimizer) -> dict:
    """What a class keeps outside `defaults` that its constructor takes back: bitsandbytes' `args` (optim_bits,
    min_8bit_size, max_unorm, skip_zeros) and `is_paged`. Its per-parameter overrides (GlobalOptimManager,
    keyed by the parameter's id) cannot follow a parameter onto shards or masters: refused, naming them."""
    cls = type(optimizer)
    if not cls.__module__.startswith("bitsandbytes"):
        return {}
    import bitsandbytes as bnb
    ours = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if any(pid in ours for pid in bnb.optim.GlobalOptimManager.get_instance().pid2config):
        raise ValueError(f"{cls.__name__} has per-parameter overrides (bitsandbytes' GlobalOptimManager."
                         "override_config), keyed by the parameters' ids, which bunsan cannot carry onto the "
                         "tensors it steps (fp32 masters, shards); give those parameters a param group of "
                         "their own with the settings instead, or use a torch optimizer")
    params = inspect.signature(cls.__init__).parameters
    return {k: getattr(optimizer, k) for k in CARRIED if k in params and hasattr(optimizer, k)}


def rebuild(cls: type, param_groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """A `cls` optimizer over `param_groups` (each with its full hyperparameters), with `defaults` as the
    original's (plus carried_keywords'): the same class, groups and settings over other tensors (fp32 masters,
    shards)."""
    opt = cls(param_groups, **constructor_keywords(cls, defaults))
    # a later add_param_group fills in what the original would
    opt.defaults = {**opt.defaults, **{k: v for k, v in defaults.items() if k not in CARRIED}}
    return opt


def group_hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
