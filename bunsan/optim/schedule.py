"""Learning-rate schedules: plain functions of the step, with DeepSpeed's names and formulas
(WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) plus constant / warmup_cosine /
warmup_linear; the engine writes the lr (and OneCycle's momentum, Adam's beta1) into every param group
before each step.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("bunsan.optim")


class LRSchedule:
    """lr for optimizer step `step` of a param group whose configured lr is `base_lr`; `step` counts the
    optimizer steps applied before this one (0 for the first; a skipped, overflowing step does not count)."""

    def __init__(self, sched_cfg, total_steps: int | None = None):
        self.type = (sched_cfg.type if sched_cfg is not None else "constant")
        self.p = dict(sched_cfg.params) if sched_cfg is not None else {}
        self.total_steps = total_steps
        key = self.type.lower()
        self._fn = {"constant": self._constant, "warmuplr": self._warmup_lr, "warmupdecaylr": self._warmup_decay,
                    "warmupcosinelr": self._warmup_cosine_ds, "warmup_cosine": self._warmup_cosine,
                    "warmup_linear": self._warmup_linear, "onecycle": self._one_cycle,
                    "lrrangetest": self._lr_range_test}.get(key)
        if self._fn is None:
            raise ValueError(f"scheduler.type '{self.type}' is not known; use WarmupLR, WarmupDecayLR, "
                             "WarmupCosineLR, OneCycle, LRRangeTest, constant, warmup_cosine or warmup_linear")

    def __call__(self, step: int, base_lr: float) -> float:
        return float(self._fn(step, base_lr))

    def apply(self, groups: list[dict], base_lrs: list[float], step: int) -> None:
        """Write optimizer step `step`'s lr (and OneCycle's betas) into the groups, built with `base_lrs`."""
        betas = self.betas(step)
        if betas is not None and not any("betas" in g for g in groups) and not self._said_no_betas:
            self._said_no_betas = True
            log.warning("scheduler OneCycle: cycle_momentum is on but the optimizer has no betas, so only the "
                        "learning rate cycles (DeepSpeed's meaning); set cycle_momentum false to say so")
        for g, base in zip(groups, base_lrs):
            g["lr"] = self(step, base)
            if betas is not None and "betas" in g:
                g["betas"] = betas

    _said_no_betas = False

    @property
    def cycles_momentum(self) -> bool:
        return self.type.lower() == "onecycle" and self.p.get("cycle_momentum", True)

    def betas(self, step: int) -> tuple[float, float] | None:
        """OneCycle's (beta1, beta2) for optimizer step `step` of an optimizer with betas; None for the others.
        DeepSpeed writes (momentum, 0.99): its OneCycle replaces the optimizer's beta2 with 0.99 throughout."""
        if not self.cycles_momentum:
            return None
        lo, hi, it = self.p["cycle_min_mom"], self.p["cycle_max_mom"], step - 1
        if it < 0:
            return lo, 0.99            # what DeepSpeed's __init__ writes, before its first scheduler step
        if it < self._cycle_size():
            return hi - (hi - lo) * self._cycle_scale(it + 1), 0.99   # inverse to the lr
        decay, rate = self.p["decay_step_size"], self.p["decay_mom_rate"]
        if decay == 0 or rate == 0:
            return hi, 0.99
        return hi * (1 + rate * (it - self._cycle_size() + 1) / decay), 0.99

    def _total(self, key: str) -> int:
        total = self.p.get(key) or self.total_steps
        if not total:
            raise ValueError(f"scheduler {self.type} needs scheduler.params.{key}; set it (or train.steps)")
        return int(total)

    @staticmethod
    def _constant(step, base_lr):
        return base_lr

    # -- DeepSpeed's schedules ------------------------------------------------------------------
    # DeepSpeed builds its scheduler at last_batch_iteration -1, and __init__ writes that iteration's lr
    # (warmup_min_lr; 0 for WarmupCosineLR) into the optimizer without stepping; its engine calls
    # scheduler.step() only after each applied optimizer step. So its optimizer step k runs with the lr of
    # iteration k - 1: a linear warm-up spends its first two steps at warmup_min_lr.

    def _warmup_steps(self) -> int:
        return max(2, int(self.p.get("warmup_num_steps", 1000)))   # DeepSpeed's clamp: log(1) would divide by 0

    def _gamma(self, it: int) -> float:
        """Warm-up progress at DeepSpeed iteration `it` (>= 0), log or linear; 1 once warmed up."""
        n = self._warmup_steps()
        if it >= n:
            return 1.0
        if self.p.get("warmup_type", "log") == "log":
            return math.log(it + 1) / math.log(n)
        return it / n

    def _bounds(self, base_lr) -> tuple[float, float]:
        hi = self.p.get("warmup_max_lr")
        return self.p.get("warmup_min_lr", 0.0), base_lr if hi is None else hi   # None: the optimizer's lr

    def _warmup_lr(self, step, base_lr):
        lo, hi = self._bounds(base_lr)
        it = step - 1
        return lo if it < 0 else lo + (hi - lo) * self._gamma(it)

    def _warmup_decay(self, step, base_lr):
        n, total, it = self._warmup_steps(), self._total("total_num_steps"), step - 1
        if it < n:
            return self._warmup_lr(step, base_lr)
        lo, hi = self._bounds(base_lr)
        return lo + (hi - lo) * max(0.0, (total - it) / max(1.0, total - n))

    def _warmup_cosine_ds(self, step, base_lr):
        n, total, it = self._warmup_steps(), self._total("total_num_steps"), step - 1
        if it < 0:
            return 0.0   # DeepSpeed's lr before its first scheduler step, whatever warmup_min_ratio is
        if it < n:
            lo = self.p.get("warmup_min_ratio", 0.0)
            return base_lr * (lo + self._gamma(it) * (1.0 - lo))
        cmin = self.p.get("cos_min_ratio", 0.0001)
        progress = min(1.0, (it - n + 1) / max(1, total - n))   # held at the floor past total_num_steps
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return base_lr * max(0.0, cmin + (1.0 - cmin) * ratio)

    # OneCycle (Smith 2018, "A disciplined approach to neural network hyper-parameters"): up from cycle_min_lr
    # to cycle_max_lr over cycle_first_step_size iterations, down again over cycle_second_step_size (each half
    # in stairs when a stair count is set), then cycle_min_lr / (1 + decay_lr_rate x iterations since the cycle
    # / decay_step_size). Its __init__ writes cycle_min_lr, so step 0 runs there; step k at iteration k.
    def _cycle_size(self) -> int:
        first, second = self.p["cycle_first_step_size"], self.p["cycle_second_step_size"]
        return first + (first if second is None else second)

    def _cycle_scale(self, it: int) -> float:
        """How far up the cycle iteration `it` is: 0 at either end, 1 at the peak."""
        first, total = self.p["cycle_first_step_size"], self._cycle_size()
        second, pos = total - first, it % total
        rising = pos <= first
        stairs = self.p["cycle_first_stair_count"] if rising else self.p["cycle_second_stair_count"]
        if stairs is None:
            stairs = self.p["cycle_first_stair_count"]
        if stairs:
            return math.floor((pos if rising else total - pos) * stairs / (first if rising else second)) / stairs
        return pos / first if rising else (total - pos) / second

    def _one_cycle(self, step, base_lr):
        lo, hi, it = self.p["cycle_min_lr"], self.p["cycle_max_lr"], step - 1
        if it < 0:
            return lo
        if it < self._cycle_size():
            return lo + (hi - lo) * self._cycle_scale(it + 1)
        decay, rate = self.p["decay_step_size"], self.p["decay_lr_rate"]
        if decay == 0 or rate == 0:
            return lo
        return lo / (1 + rate * (it - self._cycle_size() + 1) / decay)

    def _lr_range_test(self, step, base_lr):
        """lr_range_test_min_lr x (1 + step_rate x step / step_size), in stairs with staircase."""
        size, rate = self.p["lr_range_test_step_size"], self.p["lr_range_test_step_rate"]
        interval = step // size if self.p["lr_range_test_staircase"] else step / size
        return self.p["lr_range_test_min_lr"] * (1 + rate * interval)

    # -- bunsan's schedules: step 0 is the first warm-up step ------------------------------------
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
