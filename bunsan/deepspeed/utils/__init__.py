"""`deepspeed.utils`: RepeatingLoader, logger and log_dist (`deepspeed.utils.logging` holds the last two, as in
DeepSpeed)."""

from __future__ import annotations

from bunsan.deepspeed.utils.logging import log_dist, logger

__all__ = ["RepeatingLoader", "logger", "log_dist"]


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
