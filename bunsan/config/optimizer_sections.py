"""DeepSpeed's `optimizer` and `scheduler` sections: the types bunsan builds (optim/optimizers.py's table and
the schedules of optim/schedule.py), their params with DeepSpeed's defaults, and the types it refuses
(deepspeed_only.py), each checked before any work starts."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from pydantic import Field, model_validator

from bunsan.config.deepspeed_only import OPTIMIZERS_NOT_BUILT
from bunsan.config.errors import Rule, show, suggest
from bunsan.config.sections import Section
from bunsan.optim.optimizers import OPTIMIZERS as optimizer_table, optimizer_class


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


OPTIMIZERS = {key: kind.name for key, kind in optimizer_table.items()}   # lower-case -> canonical name


@functools.lru_cache(maxsize=None)
def optimizer_signature(name: str) -> dict[str, Any]:
    """Constructor keywords of the optimizer (minus `params`) and their defaults."""
    sig = inspect.signature(optimizer_class(name))
    return {k: p.default for k, p in sig.parameters.items() if k != "params"}


def placeholder(v: Any) -> str | None:
    """The problem with Hugging Face Trainer's "auto", which only the Trainer fills in; None for other values."""
    if v != "auto":
        return None
    return ("'auto' is the Hugging Face Trainer's placeholder, filled in from its TrainingArguments; bunsan has no "
            "Trainer to fill it: set a value")


def _param_problem(k: str, v: Any, d: Any) -> str | None:
    """What is wrong with optimizer parameter k = v, whose torch default is d; None when it is fine."""
    if isinstance(d, bool):
        ok, want = isinstance(v, bool), "true or false"
    elif isinstance(d, tuple):
        ok = isinstance(v, (list, tuple)) and len(v) == len(d) and all(x is None or _finite(x) for x in v)
        want = f"a list of {len(d)} finite numbers"
    elif d is None:  # foreach / fused: Optional[bool]
        ok, want = v is None or isinstance(v, bool), "true, false or null"
    elif isinstance(d, str):  # the 1-bit optimizers' comm_backend_name
        ok, want = isinstance(v, str), "a string"
    else:
        ok, want = _finite(v), "a finite number"
    if not ok:
        return placeholder(v) or f"expected {want}, got {show(v)}; set it to {want} (torch default {show(d)})"
    if k == "lr" and v <= 0:
        return f"must be > 0, got {show(v)}; set it to a positive learning rate, e.g. 3e-4"
    if k == "betas" and not all(x is None or 0 <= x < 1 for x in v):
        return f"each beta must be in [0, 1), got {show(v)}; e.g. [0.9, 0.95]"
    return None


def _check_optimizer_params(name: str, params: dict) -> list[tuple[str, str]]:
    allowed, problems = optimizer_signature(name), []
    for k, v in params.items():
        key = f"params.{k}"
        if k == "max_grad_norm":   # DeepSpeed 0.19 refuses it too
            problems.append((key, "is not an optimizer parameter; set the top-level gradient_clipping instead "
                                  "(DeepSpeed's meaning: clip the global gradient norm) and remove it"))
        elif k not in allowed:
            problems.append((key, f"torch.optim.{name} has no parameter '{k}' ({suggest(k, allowed)})"))
        elif problem := _param_problem(k, v, allowed[k]):
            problems.append((key, problem))
    return problems


def _unknown_type(section: str, name: str, known: list[str], not_built: dict[str, str], torch_home) -> Rule:
    """The error for a type bunsan does not build: why, when DeepSpeed builds it; else a did-you-mean."""
    fix = f"set it to one of {', '.join(known)}"
    if name.lower() in not_built:
        return Rule(("type", f"{section} {show(name)}: {not_built[name.lower()]}; or {fix}"))
    if hasattr(torch_home, name):   # DeepSpeed builds any class it finds there
        return Rule(("type", f"{section} {show(name)}: DeepSpeed builds {torch_home.__name__}.{name} for it; "
                             f"bunsan builds only its own list; {fix}"))
    return Rule(("type", f"unknown {section} {show(name)} ({suggest(name, known)}); {fix}"))


def _adam_switches(canon: str, params: dict) -> tuple[str, list[tuple[str, str]]]:
    """DeepSpeed's extra Adam parameters taken out of `params`: (the optimizer they mean, Adam -> AdamW, and
    the problems with them)."""
    problems = [(f"params.{k}", f"expected true/false, got {show(params.pop(k))}; set it to true or false")
                for k in ("adam_w_mode", "torch_adam", "bias_correction", "fp32_optimizer_states")
                if not isinstance(params.get(k, False), bool)]
    uncorrected = params.pop("bias_correction", True) is False
    if not params.pop("fp32_optimizer_states", True):
        problems.append(("params.fp32_optimizer_states", "false (16-bit CPU Adam moments) is not built: bunsan "
                                                         "keeps optimizer states in fp32; remove the key"))
    params.pop("torch_adam", None)  # bunsan always uses torch's optimizers
    # DeepSpeed's "Adam" is decoupled weight decay (AdamW) unless adam_w_mode is false, and its weight
    # decay defaults to 0 (as torch's Adam's): the same config means the same update here
    decoupled = canon == "AdamW" or params.pop("adam_w_mode", True)
    params.pop("adam_w_mode", None)
    if uncorrected:   # DeepSpeed's FusedAdam with bias_correction false: its own update, built as it is
        params.setdefault("weight_decay", 0.0)
        params["decoupled_weight_decay"] = decoupled
        return "UncorrectedAdam", problems
    if decoupled and canon == "Adam":
        params.setdefault("weight_decay", 0.0)
        return "AdamW", problems
    return canon, problems


class Optimizer(Section):
    """The optimizer bunsan builds when initialize() gets none; DeepSpeed's section."""
    type: str = Field("AdamW", description="AdamW, Adam, SGD, Adafactor, AdamW8bit, Lamb or a torch elementwise "
                                           "one (RMSprop, ...); Adam means AdamW, as in DeepSpeed")
    # torch defaults are merged in by bunsan.optim
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the optimizer's "
                                   "constructor (lr, betas, weight_decay, ...); torch's defaults fill the rest")

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("type", ""), str):
            return data  # pydantic reports the type error
        data, params = dict(data), data.get("params") or {}
        if not isinstance(params, dict):
            return data
        params, name = dict(params), data.get("type", "AdamW")
        canon = OPTIMIZERS.get(name.lower())
        if canon is None:
            raise _unknown_type("optimizer", name, list(OPTIMIZERS.values()), OPTIMIZERS_NOT_BUILT, torch.optim)
        problems = []
        if canon in ("Adam", "AdamW"):
            canon, problems = _adam_switches(canon, params)
        if problems := problems + _check_optimizer_params(canon, params):
            raise Rule(*problems)
        return {**data, "type": canon, "params": params}


_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"}
_OWN = {"warmup_steps": 0, "total_steps": None, "min_lr_ratio": 0.1}  # total_steps None -> train.steps
SCHEDULERS: dict[str, dict[str, Any]] = {  # type -> params and defaults; ... = required
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "warmup_max_lr": 0.001, "total_num_steps": ...},
    "WarmupCosineLR": {"total_num_steps": ..., "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    "OneCycle": {"cycle_min_lr": ..., "cycle_max_lr": ..., "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False},
    "constant": {},
    "warmup_cosine": _OWN,
    "warmup_linear": _OWN,
}


DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _check_schedule_value(k: str, v: Any) -> tuple[Any, str | None]:
    """(normalised value, problem or None) for one scheduler parameter."""
    if placeholder(v):
        return v, placeholder(v)
    if k == "warmup_type":
        ok = isinstance(v, str) and v.lower() in ("log", "linear")
        return (v.lower() if ok else v), None if ok else f"must be 'log' or 'linear', got {show(v)}; set it to 'log' or 'linear'"
    if v is None and k in ("total_steps", "warmup_max_lr", "cycle_second_step_size", "cycle_second_stair_count"):
        return v, None
    if k in ("cycle_momentum", "lr_range_test_staircase"):
        ok = isinstance(v, bool)
        return v, None if ok else f"must be true or false, got {show(v)}"
    if isinstance(v, (list, tuple)):
        return v, (f"a value per parameter group is not built; give one number for every group, got {show(v)}")
    if not _finite(v):
        return v, f"expected a finite number, got {show(v)}; set it to a number"
    if k.endswith("_steps"):
        low = 0 if k == "warmup_steps" else 1   # DeepSpeed refuses warmup_num_steps 0
        if not float(v).is_integer() or v < low:
            return v, f"must be a whole number >= {low}, got {show(v)}; set it to a step count >= {low}"
        return int(v), None
    if k.endswith(("_step_size", "_stair_count")):
        low = 1 if k in ("cycle_first_step_size", "lr_range_test_step_size") else 0   # DeepSpeed's own checks
        if not float(v).is_integer() or v < low:
            return v, f"must be a whole number >= {low}, got {show(v)}; set it to a step count >= {low}"
        return int(v), None
    if k.endswith("_mom") and not 0 <= v < 1:
        return v, f"must be in [0, 1), got {show(v)}; set it to Adam's beta1 at that point of the cycle"
    if k.endswith("_ratio") and not 0 <= v <= 1:
        return v, f"must be in [0, 1], got {show(v)}; set it to a fraction of the peak learning rate"
    if k.endswith("_lr") and v < 0:
        return v, f"must be >= 0, got {show(v)}; set it to a non-negative learning rate"
    return v, None


class Scheduler(Section):
    """The learning-rate schedule; DeepSpeed's section and types, plus bunsan's own types."""
    type: str = Field(description="DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest; "
                                  "bunsan's constant, warmup_cosine, warmup_linear")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters of the schedule type (steps count "
                                   "optimizer steps); unset ones take the type's defaults (DeepSpeed's names)")

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if isinstance(data, dict) and "type" not in data:
            raise Rule(("type", f"a scheduler needs a type; set scheduler.type to one of {', '.join(SCHEDULERS)}"))
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            return data
        params = data.get("params") or {}
        if not isinstance(params, dict):
            return data
        name = data["type"]
        canon = {n.lower(): n for n in SCHEDULERS}.get(name.lower())
        if canon is None:
            raise _unknown_type("scheduler", name, list(SCHEDULERS), {}, torch.optim.lr_scheduler)   # (all of DeepSpeed's are built)
        spec, out, problems = SCHEDULERS[canon], {}, []
        for k, v in params.items():
            if k == "last_batch_iteration" and canon in DEEPSPEED_SCHEDULERS:   # DeepSpeed's resume point
                if v != -1 or isinstance(v, bool):
                    problems.append((f"params.{k}", f"{show(v)}: bunsan's schedule follows the engine's step "
                                                    "counter, which checkpoints restore; remove it (or set -1)"))
                continue
            if k not in spec:
                problems.append((f"params.{k}", f"scheduler {canon} has no parameter '{k}' ({suggest(k, spec)})"))
                continue
            out[k], problem = _check_schedule_value(k, v)
            if problem:
                problems.append((f"params.{k}", problem))
        for k, d in spec.items():
            if k not in out and d is ...:
                what = "the total number of training steps" if k.endswith("steps") else "DeepSpeed requires it too"
                problems.append((f"params.{k}", f"scheduler {canon} requires '{k}'; add it ({what})"))
            out.setdefault(k, d)
        if problems:
            raise Rule(*problems)
        return {**data, "type": canon, "params": out}
