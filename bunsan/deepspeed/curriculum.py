"""data_efficiency's curriculum learning on the training loader `deepspeed.initialize(training_data=...)` makes.

One curriculum step per global batch (gradient_accumulation_steps micro-batches share it, as DeepSpeed's sampler
draws a global batch at a time); each metric's difficulty follows its schedule from min to max and never falls
back. Every micro-batch goes through the script's post-process function, if it set one, with the sampler's
state, as DeepSpeed calls it:

    engine.set_data_post_process_func(fn)      # fn(batch, {"curriculum_step": n, "current_difficulties": {...}})

The schedules (DeepSpeed's meaning; step s, total T, min a, max b, difficulty step d):
    fixed_linear     floor((s / T) * (b - a) + a), down to a multiple of d, at least the first multiple >= a
    fixed_root       the same with (s / T) ** (1 / root_degree)
    fixed_discrete   difficulty[i] for the first max_step[i] >= s, the last difficulty after
    custom           engine.set_custom_curriculum_learning_schedule({metric: fn(step) -> difficulty})
"""

from __future__ import annotations

import math

__all__ = ["Curriculum", "CurriculumLoader"]


class Curriculum:
    def __init__(self, metrics: dict):
        self.metrics = metrics                  # name -> config.data_efficiency.CurriculumMetric
        self.custom: dict = {}
        self.step = 0
        self.current = {name: m.min_difficulty for name, m in metrics.items()}

    def difficulty(self, name: str, step: int) -> int:
        m, cfg = self.metrics[name], self.metrics[name].schedule_config
        if m.schedule_type == "custom":
            if name not in self.custom:
                raise RuntimeError(f"curriculum metric {name!r} has schedule_type custom but no schedule was set: "
                                   "call engine.set_custom_curriculum_learning_schedule({name: fn}) first")
            return self.custom[name](step)
        if m.schedule_type == "fixed_discrete":
            for limit, level in zip(cfg["max_step"], cfg["difficulty"]):
                if step <= limit:
                    return level
            return cfg["difficulty"][-1]
        root = 1.0 if m.schedule_type == "fixed_linear" else float(cfg["root_degree"])
        d = int(cfg["difficulty_step"])
        level = math.floor((step / cfg["total_curriculum_step"]) ** (1.0 / root) * (m.max_difficulty -
                                                                                      m.min_difficulty)
                           + m.min_difficulty)
        level -= level % d
        level = max(level, -(-m.min_difficulty // d) * d)   # never below the first allowed level
        return min(level, m.max_difficulty)

    def advance(self) -> None:
        """The next global batch: one curriculum step; each difficulty rises until it reaches its max."""
        self.step += 1
        for name, m in self.metrics.items():
            if self.current[name] < m.max_difficulty:
                self.current[name] = self.difficulty(name, self.step)

    def state_dict(self) -> dict:
        return {"curriculum_step": self.step, "current_difficulties": dict(self.current)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.current = int(state["curriculum_step"]), dict(state["current_difficulties"])


class CurriculumLoader:
    """The training loader with the curriculum: iterates the DataLoader, advancing the curriculum at the first
    micro-batch of every global batch and passing each batch through the post-process function."""

    def __init__(self, loader, curriculum: Curriculum, micro_batches_per_step: int):
        self.loader, self.curriculum = loader, curriculum
        self.per_step = micro_batches_per_step
        self.post_process_func = None
        self._drawn = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["loader"], name)

    def __iter__(self):
        for batch in self.loader:
            if self._drawn % self.per_step == 0:
                self.curriculum.advance()
            self._drawn += 1
            if self.post_process_func is not None:
                batch = self.post_process_func(batch, self.curriculum.state_dict())
            yield batch
