"""`deepspeed.runtime.lr_schedules`: the names of DeepSpeed's schedulers (accelerate tests a scheduler's class
name against VALID_LR_SCHEDULES). bunsan builds them from the config's `scheduler` section (schedulers.py);
the classes themselves are not importable objects here."""

from __future__ import annotations

__all__ = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR"]

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


def __getattr__(name: str):
    if name in VALID_LR_SCHEDULES:
        from bunsan.deepspeed.absent import Absent
        return Absent(f"deepspeed.runtime.lr_schedules.{name}", "scheduler class; bunsan builds it from the "
                      f"config: \"scheduler\": {{\"type\": \"{name}\", \"params\": {{...}}}}")
    raise AttributeError(f"module 'deepspeed.runtime.lr_schedules' has no attribute {name!r}")
