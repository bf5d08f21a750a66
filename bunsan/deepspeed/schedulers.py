"""The learning-rate scheduler `deepspeed.initialize` returns: the config's schedule (bunsan's engine sets
each step's lr from it) or the client's scheduler (which the engine steps after every applied step, as
DeepSpeed's does).
"""

from __future__ import annotations

import torch


class ConfiguredScheduler:
    """The config's `scheduler` section as DeepSpeed's scheduler object: what it reports follows the engine's
    step counters; the engine steps it, so `step()` from the script is refused (it would step twice)."""

    def __init__(self, engine):
        self._engine = engine

    @property
    def last_batch_iteration(self) -> int:
        return self._engine.global_step - self._engine.skipped_steps - 1

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self._engine.optimizer.param_groups]

    get_last_lr = get_lr

    def step(self, *args, **kwargs):
        raise RuntimeError("the engine steps the configured scheduler after every optimizer step, as DeepSpeed's "
                           "does; calling lr_scheduler.step() as well would advance it twice: remove the call")

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        if state.get("last_batch_iteration") != self.last_batch_iteration:
            raise ValueError(f"scheduler state at iteration {state.get('last_batch_iteration')} while the engine is "
                             f"at {self.last_batch_iteration}: the configured schedule follows the engine's step "
                             "counters, which engine.load_checkpoint restores")


class ClientScheduler:
    """A scheduler the script made (an object, or a callable given the engine's optimizer), stepped by the
    engine after every applied step; its lrs are copied into the engine's optimizer before the next one."""

    def __init__(self, scheduler, optimizer):
        self.scheduler = scheduler
        self.source = getattr(scheduler, "optimizer", None) or optimizer
        # ZeRO 1-3 step this rank's shard with groups of their own, each part of one of the user's groups
        self.sources = getattr(optimizer, "group_sources", None) or list(range(len(optimizer.param_groups)))
        if max(self.sources) >= len(self.source.param_groups):
            raise ValueError(f"the lr_scheduler's optimizer has {len(self.source.param_groups)} parameter groups, "
                             f"fewer than the engine's optimizer was built with: build the scheduler over the "
                             "optimizer passed to initialize (or pass a callable taking the optimizer)")

    def copy_lrs(self, optimizer: torch.optim.Optimizer) -> None:
        if self.source is not optimizer:
            for mine, gi in zip(optimizer.param_groups, self.sources):
                mine["lr"] = self.source.param_groups[gi]["lr"]

    def step(self, *args, **kwargs):
        # the engine's optimizer stepped in place of the script's: tell torch's scheduler, which otherwise
        # warns that its optimizer was never stepped
        self.source._opt_called = True
        return self.scheduler.step(*args, **kwargs)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.source.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr() if hasattr(self.scheduler, "get_last_lr") else self.get_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        # torch's schedulers leave the lr to the optimizer's own load_state_dict, which never runs on the
        # script's optimizer (the engine's holds the state): its groups take the scheduler's last lrs here,
        # or the first step after a resume would run at the lr the optimizer was built with
        if hasattr(self.scheduler, "get_last_lr"):
            for group, lr in zip(self.source.param_groups, self.scheduler.get_last_lr()):
                group["lr"] = lr

    def __getattr__(self, name: str):
        return getattr(self.__dict__["scheduler"], name)
