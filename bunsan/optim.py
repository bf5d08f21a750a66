"""Optimizer and learning-rate schedule factory.

Optimizers are torch's own (AdamW, Adam, SGD, Adafactor); the config's
`optimizer.params` go to the constructor unchanged, so DeepSpeed's JSON works.
Schedules are plain functions of the step, with DeepSpeed's names and formulas
(WarmupLR, WarmupDecayLR, WarmupCosineLR) plus constant / warmup_cosine /
warmup_linear; the engine writes the lr into every param group before each step.
"""

from __future__ import annotations

import math

import torch

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
              "adafactor": torch.optim.Adafactor}


def optimizer_class(name: str):
    """torch's optimizer of that name, or bitsandbytes' AdamW8bit (blockwise 8-bit moments)."""
    if name.lower() == "adamw8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise ValueError("optimizer.type AdamW8bit needs the bitsandbytes package (pip install "
                             "'bitsandbytes>=0.50', which has CPU kernels too); install it or use AdamW") from None
        return bitsandbytes.optim.AdamW8bit
    return OPTIMIZERS[name.lower()]


def _configured(opt_cfg, device: torch.device):
    """The optimizer class and constructor keywords from the config (fused on CUDA unless the user chose)."""
    cls = optimizer_class(opt_cfg.type)
    kwargs = dict(opt_cfg.params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    if device.type == "cuda" and cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        if "foreach" not in kwargs and "fused" not in kwargs:
            kwargs["fused"] = True
    return cls, kwargs


def build_optimizer(params_or_groups, opt_cfg, device: torch.device) -> torch.optim.Optimizer:
    """Build the configured optimizer over `params_or_groups`."""
    cls, kwargs = _configured(opt_cfg, device)
    return cls(params_or_groups, **kwargs)


def optimizer_spec(user_optimizer, opt_cfg, params: list, device: torch.device):
    """(class, constructor defaults, [(parameter indices, group hyperparameters)]) for a sharded optimizer.

    A user-built optimizer keeps its class, defaults and per-group hyperparameters.
    """
    if user_optimizer is None:
        cls, kwargs = _configured(opt_cfg, device)
        return cls, kwargs, [(list(range(len(params))), {})]
    if any(user_optimizer.state.values()):
        raise ValueError("the optimizer passed to bunsan.initialize already has state; pass a fresh optimizer")
    index = {p: i for i, p in enumerate(params)}
    groups = [([index[p] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
              for g in user_optimizer.param_groups]
    return type(user_optimizer), dict(user_optimizer.defaults), groups


def rebuild_over(optimizer: torch.optim.Optimizer, mapping: dict) -> torch.optim.Optimizer:
    """The same optimizer class and hyperparameters (per group) over other tensors (fp32 masters).

    `mapping` maps each model parameter to the tensor that replaces it. A user-built optimizer is
    honoured this way when bunsan keeps fp32 master weights for a 16-bit model.
    """
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({"params": [mapping[p] for p in g["params"]], **hyper})
    if any(optimizer.state.values()):
        raise ValueError("the optimizer passed to bunsan.initialize already has state; pass a fresh optimizer "
                         "(bunsan moves it onto its fp32 master weights) or load state after initialize")
    return type(optimizer)(groups, **optimizer.defaults)


class LRSchedule:
    """lr for optimizer step `step` (0-based) of a param group whose configured lr is `base_lr`."""

    def __init__(self, sched_cfg, total_steps: int | None = None):
        self.type = (sched_cfg.type if sched_cfg is not None else "constant")
        self.p = dict(sched_cfg.params) if sched_cfg is not None else {}
        self.total_steps = total_steps
        key = self.type.lower()
        self._fn = {"constant": self._constant, "warmuplr": self._warmup_lr, "warmupdecaylr": self._warmup_decay,
                    "warmupcosinelr": self._warmup_cosine_ds, "warmup_cosine": self._warmup_cosine,
                    "warmup_linear": self._warmup_linear}.get(key)
        if self._fn is None:
            raise ValueError(f"scheduler.type '{self.type}' is not known; use WarmupLR, WarmupDecayLR, "
                             "WarmupCosineLR, constant, warmup_cosine or warmup_linear")

    def __call__(self, step: int, base_lr: float) -> float:
        return float(self._fn(step, base_lr))

    def _total(self, key: str) -> int:
        total = self.p.get(key) or self.total_steps
        if not total:
            raise ValueError(f"scheduler {self.type} needs scheduler.params.{key}; set it (or train.steps)")
        return int(total)

    # DeepSpeed: warm-up gamma, log or linear, reaching 1 at warmup_num_steps.
    def _gamma(self, step: int) -> float:
        n = max(2, int(self.p.get("warmup_num_steps", 1000)))
        if step >= n:
            return 1.0
        if self.p.get("warmup_type", "log") == "log":
            return math.log(step + 1) / math.log(n)
        return step / n

    @staticmethod
    def _constant(step, base_lr):
        return base_lr

    def _warmup_lr(self, step, base_lr):
        lo, hi = self.p.get("warmup_min_lr", 0.0), self.p.get("warmup_max_lr", 0.001)
        return lo + (hi - lo) * self._gamma(step)

    def _warmup_decay(self, step, base_lr):
        n, total = max(2, int(self.p.get("warmup_num_steps", 1000))), self._total("total_num_steps")
        if step < n:
            return self._warmup_lr(step, base_lr)
        lo, hi = self.p.get("warmup_min_lr", 0.0), self.p.get("warmup_max_lr", 0.001)
        return lo + (hi - lo) * max(0.0, (total - step) / max(1.0, total - n))

    def _warmup_cosine_ds(self, step, base_lr):
        n, total = max(2, int(self.p.get("warmup_num_steps", 1000))), self._total("total_num_steps")
        if step < n:
            lo = self.p.get("warmup_min_ratio", 0.0)
            return base_lr * (lo + self._gamma(step) * (1.0 - lo))
        cmin = self.p.get("cos_min_ratio", 0.0001)
        ratio = (1 + math.cos(math.pi * (step - n + 1) / max(1, total - n))) / 2
        return base_lr * max(0.0, cmin + (1.0 - cmin) * ratio)

    def _decay_fraction(self, step) -> float | None:
        """None during warm-up, else how far through the decay phase we are (0..1)."""
        warm, total = int(self.p.get("warmup_steps", 0)), self._total("total_steps")
        if step < warm:
            return None
        return min(1.0, (step - warm) / max(1, total - warm))

    def _warmup_cosine(self, step, base_lr):
        frac, floor = self._decay_fraction(step), self.p.get("min_lr_ratio", 0.1)
        if frac is None:
            return base_lr * (step + 1) / int(self.p["warmup_steps"])
        return base_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))

    def _warmup_linear(self, step, base_lr):
        frac, floor = self._decay_fraction(step), self.p.get("min_lr_ratio", 0.1)
        if frac is None:
            return base_lr * (step + 1) / int(self.p["warmup_steps"])
        return base_lr * (1 - (1 - floor) * frac)
