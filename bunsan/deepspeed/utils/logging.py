"""`deepspeed.utils.logging`: the logger DeepSpeed scripts log through, and log_dist (log on some ranks)."""

from __future__ import annotations

import logging

from bunsan.comm import functional as world

__all__ = ["logger", "log_dist", "should_log_le"]

logger = logging.getLogger("bunsan.deepspeed")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the listed ranks only (all with -1 in the list; rank 0 when ranks is None, as DeepSpeed)."""
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or world.get_rank() in ranks:
        logger.log(level, f"[Rank {world.get_rank()}] {message}")


def should_log_le(max_log_level_str: str) -> bool:
    """Whether the logger's level is at or below `max_log_level_str` ('info', 'debug', ...), as DeepSpeed's."""
    if max_log_level_str.lower() not in _LEVELS:
        raise ValueError(f"{max_log_level_str!r} is not a log level; use one of {sorted(_LEVELS)}")
    return logger.getEffectiveLevel() <= _LEVELS[max_log_level_str.lower()]
