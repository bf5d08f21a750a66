"""DeepSpeed's schedules step for step: the lr of bunsan's optimizer step k equals the lr DeepSpeed 0.19's
optimizer uses at its step k. The reference below is written from DeepSpeed's documented formulas and its
iteration counting, not from bunsan's code: the scheduler starts at last_batch_iteration -1 and its __init__
writes that iteration's lr into the optimizer; the engine calls scheduler.step() after every applied
optimizer step (deepspeed/runtime/engine.py, _take_model_step)."""

from __future__ import annotations

import itertools
import math

import pytest

import bunsan
from bunsan.config.root import Config, ConfigError
from bunsan.optim.schedule import LRSchedule
from parity import batches, tiny_model

BASE_LR = 3e-4   # the optimizer's configured lr


class ReferenceScheduler:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR over one param group, from the formulas."""

    def __init__(self, kind: str, params: dict, group: dict):
        self.kind, self.group = kind, group
        self.min_lr = params.get("warmup_min_lr", 0.0)
        default_max = None if kind == "WarmupLR" else 0.001
        self.max_lr = params.get("warmup_max_lr", default_max)
        if self.max_lr is None:
            self.max_lr = group["lr"]
        self.warmup = max(2, params.get("warmup_num_steps", 1000))
        self.log = params.get("warmup_type", "log") == "log"
        self.total = params.get("total_num_steps")
        self.min_ratio = params.get("warmup_min_ratio", 0.0)
        self.cos_min = params.get("cos_min_ratio", 0.0001)
        self.org_lr = group["lr"]
        self.last_batch_iteration = -1
        group["lr"] = self.lr()      # __init__ with last_batch_iteration -1: no step, just the lr

    def step(self):
        self.last_batch_iteration += 1
        self.group["lr"] = self.lr()

    def warm(self, it: int) -> float:
        return math.log(it + 1) / math.log(self.warmup) if self.log else it / self.warmup

    def lr(self) -> float:
        it = self.last_batch_iteration
        if self.kind == "WarmupCosineLR":
            return 0.0 if it < 0 else self.org_lr * self.cosine_ratio(it)
        if it < 0:
            return self.min_lr
        if it < self.warmup:
            gamma = self.warm(it)
        elif self.kind == "WarmupLR":
            gamma = 1.0
        else:
            gamma = max(0.0, (self.total - it) / max(1.0, self.total - self.warmup))
        return self.min_lr + (self.max_lr - self.min_lr) * gamma

    def cosine_ratio(self, it: int) -> float:
        if it < self.warmup:
            return self.min_ratio + self.warm(it) * (1 - self.min_ratio)
        done = min(1.0, (it - self.warmup + 1) / max(1, self.total - self.warmup))
        return max(0.0, self.cos_min + (1 - self.cos_min) * (1 + math.cos(math.pi * done)) / 2)


def deepspeed_lrs(kind: str, params: dict, steps: int) -> list[float]:
    """The lr DeepSpeed's optimizer uses at each of its first `steps` steps (no overflow)."""
    group = {"lr": BASE_LR}
    sched = ReferenceScheduler(kind, params, group)
    out = []
    for _ in range(steps):
        out.append(group["lr"])   # optimizer.step() reads the group's lr
        sched.step()              # then the engine steps the scheduler
    return out


def bunsan_lrs(kind: str, params: dict, steps: int) -> list[float]:
    sched = LRSchedule(Config.load({"scheduler": {"type": kind, "params": params}}).scheduler, total_steps=None)
    return [sched(k, BASE_LR) for k in range(steps)]


WARMUPS = [{"warmup_num_steps": n, "warmup_type": t} for n, t in itertools.product((1, 2, 3, 10, 1000), ("log", "linear"))]
BOUNDS = [{}, {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01}, {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3},
          {"warmup_min_lr": 0.002, "warmup_max_lr": 0.001}]
CASES = (
    [("WarmupLR", {**w, **b}) for w in WARMUPS for b in BOUNDS]
    + [("WarmupDecayLR", {**w, **b, "total_num_steps": t}) for w in WARMUPS for b in BOUNDS for t in (1, 10, 25, 2000)]
    + [("WarmupCosineLR", {**w, "total_num_steps": t, **r}) for w in WARMUPS for t in (1, 10, 25, 2000)
       for r in ({}, {"warmup_min_ratio": 0.1, "cos_min_ratio": 0.0}, {"warmup_min_ratio": 1.0, "cos_min_ratio": 0.5})]
)


@pytest.mark.parametrize("kind,params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_lr_of_every_step_equals_deepspeeds(kind, params):
    steps = max(params["warmup_num_steps"], params.get("total_num_steps", 0)) + 40
    want, got = deepspeed_lrs(kind, params, steps), bunsan_lrs(kind, params, steps)
    bad = [(k, g, w) for k, (g, w) in enumerate(zip(got, want)) if not math.isclose(g, w, rel_tol=1e-12, abs_tol=0)]
    assert not bad, f"{kind} {params}: (step, bunsan, DeepSpeed) {bad[:5]}"


def test_a_linear_warmup_spends_its_first_two_steps_at_the_minimum():
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}
    assert bunsan_lrs("WarmupLR", params, 7) == [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01]
    cosine = bunsan_lrs("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 4, "warmup_min_ratio": 0.5,
                                           "warmup_type": "linear"}, 3)
    assert cosine == [0.0, BASE_LR * 0.5, BASE_LR * 0.625]   # step 0 is 0 whatever warmup_min_ratio is


def test_warmup_lr_without_a_maximum_warms_up_to_the_optimizers_lr():
    assert bunsan_lrs("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, 4)[-1] == BASE_LR
    assert Config.load({"scheduler": {"type": "WarmupLR"}}).scheduler.params["warmup_max_lr"] is None
    assert Config.load({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}}
                       ).scheduler.params["warmup_max_lr"] == 0.001


def test_deepspeeds_resume_point_and_zero_warmup():
    cfg = Config.load({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}}})
    assert "last_batch_iteration" not in cfg.scheduler.params
    with pytest.raises(ConfigError, match=r"scheduler.params.last_batch_iteration: 5: .*remove it"):
        Config.load({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}})
    with pytest.raises(ConfigError, match=r"scheduler.params.warmup_num_steps: must be a whole number >= 1"):
        Config.load({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}})


def test_the_engine_steps_with_deepspeeds_lr_and_skipped_steps_do_not_advance_it():
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 3, "warmup_type": "linear"}
    engine = bunsan.initialize(tiny_model(), {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {
        "lr": 0.1}}, "scheduler": {"type": "WarmupLR", "params": params}})
    seen = []
    for b in batches(5, 2):
        seen.append(engine.lr)   # the lr the coming optimizer step uses
        engine.train_batch(b)
    assert seen == pytest.approx(deepspeed_lrs("WarmupLR", params, 5), rel=1e-12)
    engine.skipped_steps += 1    # as an overflowing fp16 step leaves it: DeepSpeed does not step its scheduler
    engine.load_state_dict(engine.state_dict())
    assert engine.lr == pytest.approx(deepspeed_lrs("WarmupLR", params, 5)[-1])
