"""DeepSpeed's OneCycle and LRRangeTest step for step: the lr (and OneCycle's Adam betas) of bunsan's optimizer
step k equal what DeepSpeed 0.19's optimizer uses at its step k. The reference is written from the schedules'
documented formulas (Smith 2018's one cycle: x = 1 + i / cycle - floor(1 + i / cycle), rising while x <= the
first half's share) and DeepSpeed's iteration counting (tests/test_lr_schedule.py), not from bunsan's code."""

from __future__ import annotations

import math

import pytest

import bunsan
from bunsan.config.root import Config, ConfigError
from bunsan.optim.schedule import LRSchedule
from parity import batches, tiny_model

ONE_CYCLE = {"decay_lr_rate": 0.0, "cycle_first_step_size": 2000, "cycle_second_step_size": None,
             "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
             "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0}


class ReferenceOneCycle:
    def __init__(self, params: dict, group: dict):
        p = self.p = {**ONE_CYCLE, **params}
        self.first = p["cycle_first_step_size"]
        self.second = self.first if p["cycle_second_step_size"] is None else p["cycle_second_step_size"]
        self.stairs = (p["cycle_first_stair_count"], p["cycle_first_stair_count"] if p["cycle_second_stair_count"]
                       is None else p["cycle_second_stair_count"])
        self.group, self.it = group, -1
        group["lr"] = p["cycle_min_lr"]
        if p["cycle_momentum"]:
            group["betas"] = (p["cycle_min_mom"], 0.99)

    def scale(self) -> float:
        i, total = self.it + 1, self.first + self.second
        x = 1 + i / total - math.floor(1 + i / total)
        share = self.first / total
        up = x <= share
        s = x / share if up else (x - 1) / (share - 1)
        stairs = self.stairs[0] if up else self.stairs[1]
        if stairs > 0:
            at = i % total
            s = math.floor((at * stairs / self.first) if at <= self.first
                           else ((total - at) * stairs / self.second)) / stairs
        return s

    def step(self):
        self.it += 1
        p, total = self.p, self.first + self.second
        lo, hi, mlo, mhi = p["cycle_min_lr"], p["cycle_max_lr"], p["cycle_min_mom"], p["cycle_max_mom"]
        if self.it < total:
            s = self.scale()
            lr, mom = lo + (hi - lo) * s, mhi - (mhi - mlo) * s
        else:
            done = self.it - total + 1
            lr = lo if not p["decay_step_size"] or not p["decay_lr_rate"] else \
                lo / (1 + p["decay_lr_rate"] * done / p["decay_step_size"])
            mom = mhi if not p["decay_step_size"] or not p["decay_mom_rate"] else \
                mhi * (1 + p["decay_mom_rate"] * done / p["decay_step_size"])
        self.group["lr"] = lr
        if p["cycle_momentum"]:
            self.group["betas"] = (mom, 0.99)


class ReferenceRangeTest:
    def __init__(self, params: dict, group: dict):
        self.lo = params.get("lr_range_test_min_lr", 1e-3)
        self.size = params.get("lr_range_test_step_size", 2000)
        self.rate = params.get("lr_range_test_step_rate", 1.0)
        self.stairs = params.get("lr_range_test_staircase", False)
        self.group, self.it = group, -1
        group["lr"] = self.lo

    def step(self):
        self.it += 1
        done = (self.it + 1) / self.size
        self.group["lr"] = self.lo * (1 + self.rate * (math.floor(done) if self.stairs else done))


def deepspeed_steps(kind: str, params: dict, steps: int) -> list[tuple]:
    group = {"lr": 1e-3, "betas": (0.9, 0.999)}
    sched = (ReferenceOneCycle if kind == "OneCycle" else ReferenceRangeTest)(params, group)
    out = []
    for _ in range(steps):
        out.append((group["lr"], group["betas"]))   # the optimizer's step reads them
        sched.step()                                 # then the engine steps the scheduler
    return out


def bunsan_steps(kind: str, params: dict, steps: int) -> list[tuple]:
    sched = LRSchedule(Config.load({"scheduler": {"type": kind, "params": params}}).scheduler)
    out = []
    for k in range(steps):
        group = {"lr": 1e-3, "betas": (0.9, 0.999)}
        sched.apply([group], [1e-3], k)
        out.append((group["lr"], group["betas"]))
    return out


CYCLES = [
    {"cycle_min_lr": 0.004, "cycle_max_lr": 0.015, "cycle_first_step_size": 10, "cycle_second_step_size": 3},
    {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 7},
    # the qanet config's shape (DeepSpeedExamples' 1-cycle): stairs in both halves and a decay after the cycle
    {"cycle_min_lr": 0.004, "cycle_max_lr": 0.015, "cycle_first_step_size": 40, "cycle_second_step_size": 10,
     "cycle_first_stair_count": 8, "cycle_second_stair_count": 5, "decay_step_size": 4, "decay_lr_rate": 0.01},
    {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1, "cycle_first_step_size": 5, "cycle_first_stair_count": 2,
     "decay_step_size": 3, "decay_lr_rate": 0.5, "decay_mom_rate": 0.01, "cycle_min_mom": 0.85,
     "cycle_max_mom": 0.95},
    {"cycle_min_lr": 0.01, "cycle_max_lr": 0.02, "cycle_first_step_size": 4, "cycle_second_step_size": 0},
    {"cycle_min_lr": 0.01, "cycle_max_lr": 0.02, "cycle_first_step_size": 4, "cycle_momentum": False},
]
RANGES = [{}, {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0},
          {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4, "lr_range_test_staircase": True}]
CASES = [("OneCycle", p) for p in CYCLES] + [("LRRangeTest", p) for p in RANGES]


@pytest.mark.parametrize("kind,params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_every_step_equals_deepspeeds(kind, params):
    steps = 130
    want, got = deepspeed_steps(kind, params, steps), bunsan_steps(kind, params, steps)
    for k, ((lr, betas), (want_lr, want_betas)) in enumerate(zip(got, want)):
        assert math.isclose(lr, want_lr, rel_tol=1e-12, abs_tol=1e-15), (k, lr, want_lr)
        assert betas == pytest.approx(want_betas, rel=1e-12), (k, betas, want_betas)


def test_the_engine_cycles_adams_betas_and_the_lr():
    params = {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 2, "cycle_second_step_size": 2}
    engine = bunsan.initialize(tiny_model(), {"train_batch_size": 2, "zero_optimization": {"stage": 1},
                                              "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
                                              "scheduler": {"type": "OneCycle", "params": params}})
    seen = []
    for b in batches(6, 2):
        seen.append([(g["lr"], g["betas"]) for g in engine.optimizer.param_groups])   # what the step reads
        engine.train_batch(b)
    want = deepspeed_steps("OneCycle", params, 6)
    assert all(groups == [want[k]] * len(groups) for k, groups in enumerate(seen)), (seen, want)


def test_an_optimizer_without_betas_cycles_only_the_lr(caplog):
    sched = LRSchedule(Config.load({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 2}}}).scheduler)
    group = {"lr": 0.5, "momentum": 0.9}
    sched.apply([group], [0.5], 1)
    assert group == {"lr": pytest.approx(0.15), "momentum": 0.9}
    assert "has no betas" in caplog.text


@pytest.mark.parametrize("params,error", [
    ({"cycle_max_lr": 0.1}, r"params.cycle_min_lr: scheduler OneCycle requires 'cycle_min_lr'"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 0}, r"cycle_first_step_size: must be a "
     r"whole number >= 1"),
    ({"cycle_min_lr": [0.1, 0.2], "cycle_max_lr": 0.2}, r"cycle_min_lr: a value per parameter group is not built"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_momentum": "yes"}, r"cycle_momentum: must be true or false"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_max_mom": 1.0}, r"cycle_max_mom: must be in \[0, 1\)"),
    ({"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_lenght": 3}, r"has no parameter 'cycle_lenght'"),
])
def test_bad_one_cycle_params_name_the_key(params, error):
    with pytest.raises(ConfigError, match=error):
        Config.load({"scheduler": {"type": "OneCycle", "params": params}})


def test_deepspeeds_resume_point_is_accepted_at_minus_one():
    cfg = Config.load({"scheduler": {"type": "LRRangeTest", "params": {"last_batch_iteration": -1}}})
    assert "last_batch_iteration" not in cfg.scheduler.params
    with pytest.raises(ConfigError, match=r"last_batch_iteration: 7"):
        Config.load({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2,
                                                                  "last_batch_iteration": 7}}})
