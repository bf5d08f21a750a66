"""`deepspeed.utils`: RepeatingLoader, logger and log_dist."""

from __future__ import annotations

import logging

from bunsan.comm import functional as world

__all__ = ["RepeatingLoader", "logger", "log_dist"]

logger = logging.getLogger("bunsan.deepspeed")


class RepeatingLoader:
    """Iterate a loader forever, starting it again when it ends (a pipeline engine draws micro-batches from
    it). As DeepSpeed's, it does not call the sampler's set_epoch: a DistributedSampler repeats one order
    every pass unless the script sets the epoch itself."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the listed ranks only (all with -1 in the list; rank 0 when ranks is None, as DeepSpeed)."""
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or world.get_rank() in ranks:
        logger.log(level, f"[Rank {world.get_rank()}] {message}")
