"""`engine.tput_timer`: DeepSpeed's throughput timer, fed by the engine at every optimizer step.

Scripts call `update_epoch_count()` at each epoch's end (DeepSpeed-Chat does) and read `avg_samples_per_sec()`.
"""

from __future__ import annotations

import time

__all__ = ["ThroughputTimer"]


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2):
        self.batch_size = batch_size          # samples per optimizer step, over every data-parallel rank
        self.start_step = start_step          # steps left out of the average (warm-up), as DeepSpeed
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._started: float | None = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = False) -> None:
        if self._started is None:
            return
        elapsed, self._started = time.perf_counter() - self._started, None
        self.micro_step_count += 1
        self.step_elapsed_time += elapsed
        if global_step:
            self.global_step_count += 1
            if self.global_step_count > self.start_step:
                self.total_elapsed_time += self.step_elapsed_time
            self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")              # DeepSpeed's answer before any step was timed
        return self.batch_size * timed / self.total_elapsed_time
