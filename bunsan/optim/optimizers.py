"""The optimizers bunsan builds: one table, and the factory over it.

Optimizers are torch's own (AdamW, Adam, SGD, Adafactor and its other elementwise ones) and bitsandbytes'
AdamW8bit; the config's `optimizer.params` go to the constructor unchanged, so DeepSpeed's JSON works. The
config validates names against this table and the planner prices them from it, so an optimizer added here is
known everywhere; how each one steps, and so where it may, is optim/stepping.py's table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from bunsan.optim.stepping import carried_keywords, group_hyperparameters, rebuild, refuse_stepped


@dataclass(frozen=True)
class OptimizerKind:
    name: str                  # as the config spells it (matched case-insensitively)
    where: str                 # the class, imported when first built
    fused_on_cuda: bool        # torch has a fused CUDA kernel: use it unless the user chose foreach/fused
    install: str = ""          # how to get the package when it is not torch


OPTIMIZERS = {k.name.lower(): k for k in (
    OptimizerKind("AdamW", "torch.optim.AdamW", True),
    OptimizerKind("Adam", "torch.optim.Adam", True),
    OptimizerKind("SGD", "torch.optim.SGD", True),
    OptimizerKind("Adafactor", "torch.optim.Adafactor", False),
    # torch's other elementwise optimizers (optim/stepping.py): DeepSpeed builds any torch.optim class by name
    *(OptimizerKind(n, f"torch.optim.{n}", False)
      for n in ("RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop")),
    # blockwise 8-bit moments; its CPU kernels make it testable without a GPU
    OptimizerKind("AdamW8bit", "bitsandbytes.optim.AdamW8bit", False, "pip install 'bitsandbytes>=0.50'"),
    # DeepSpeed's FusedLamb, and its FusedAdam with bias_correction false (optim/deepspeed_optimizers.py)
    OptimizerKind("Lamb", "bunsan.optim.deepspeed_optimizers.Lamb", False),
    OptimizerKind("UncorrectedAdam", "bunsan.optim.deepspeed_optimizers.UncorrectedAdam", False),
    # their own compressed communication in place of the gradient all-reduce (optim/onebit.py)
    *(OptimizerKind(n, f"bunsan.optim.onebit.{n}", False) for n in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")),
)}


def optimizer_class(name: str):
    """The class of the optimizer the config names (its module is imported only now)."""
    kind = OPTIMIZERS[name.lower()]
    module, cls = kind.where.rsplit(".", 1)
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError:
        raise ValueError(f"optimizer.type {kind.name} needs the {module.split('.')[0]} package ({kind.install}); "
                         "install it or use AdamW") from None


def _configured(opt_cfg, device: torch.device):
    """The optimizer class and constructor keywords from the config (fused on CUDA unless the user chose)."""
    cls = optimizer_class(opt_cfg.type)
    kwargs = dict(opt_cfg.params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if device.type == "cuda" and OPTIMIZERS[opt_cfg.type.lower()].fused_on_cuda:
        if "foreach" not in kwargs and "fused" not in kwargs:
            kwargs["fused"] = True
    try:   # the optimizer's own checks, on one scalar, so that its message comes with the config key
        cls([torch.zeros(1, requires_grad=True)], **{k: v for k, v in kwargs.items() if k != "fused"})
    except (ValueError, TypeError) as e:
        raise ValueError(f"optimizer.params {kwargs}: {cls.__name__} refuses them ({e}); fix the value in the "
                         "config's optimizer.params") from None
    return cls, kwargs


def build_optimizer(params_or_groups, opt_cfg, device: torch.device) -> torch.optim.Optimizer:
    """Build the configured optimizer over `params_or_groups`."""
    cls, kwargs = _configured(opt_cfg, device)
    return cls(params_or_groups, **kwargs)


def optimizer_spec(user_optimizer, opt_cfg, params: list, device: torch.device):
    """(class, constructor defaults, [(parameters, group hyperparameters)]) for a sharded optimizer, the groups
    by parameter, since each strategy orders parameters its own way (ZeRO-3 by unit).

    A user-built optimizer keeps its class, defaults and per-group hyperparameters.
    """
    if user_optimizer is None:
        cls, kwargs = _configured(opt_cfg, device)
        return cls, kwargs, [(list(params), {})]
    refuse_stepped(user_optimizer)
    return type(user_optimizer), {**user_optimizer.defaults, **carried_keywords(user_optimizer)}, \
        [(list(g["params"]), group_hyperparameters(g)) for g in user_optimizer.param_groups]


def group_indices(groups: list, params: list) -> list[tuple[list[int], dict]]:
    """optimizer_spec's groups as indices into `params` (a strategy's order)."""
    index = {id(p): i for i, p in enumerate(params)}
    return [([index[id(p)] for p in members], hyper) for members, hyper in groups]


def rebuild_over(optimizer: torch.optim.Optimizer, mapping: dict) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters (per group) over other tensors (fp32 masters).

    `mapping` maps each model parameter to the tensor that replaces it. A user-built optimizer is
    honoured this way when bunsan keeps fp32 master weights for a 16-bit model.
    """
    refuse_stepped(optimizer)
    groups = [{"params": [mapping[p] for p in g["params"]], **group_hyperparameters(g)}
              for g in optimizer.param_groups]
    return rebuild(type(optimizer), groups, {**optimizer.defaults, **carried_keywords(optimizer)})


def restricted_to(optimizer: torch.optim.Optimizer | None, params: list) -> torch.optim.Optimizer | None:
    """The same optimizer class and per-group hyperparameters over the members of `params` only (a group left
    empty is dropped): expert parallelism steps the experts and the other weights with two of them."""
    if optimizer is None:
        return None
    refuse_stepped(optimizer)
    keep = {id(p) for p in params}
    groups = [{"params": [p for p in g["params"] if id(p) in keep], **group_hyperparameters(g)}
              for g in optimizer.param_groups]
    return rebuild(type(optimizer), [g for g in groups if g["params"]],
                   {**optimizer.defaults, **carried_keywords(optimizer)})
