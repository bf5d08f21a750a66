"""`deepspeed.runtime.utils`: set_random_seed and see_memory_usage."""

from __future__ import annotations

import random

import numpy as np
import torch

from bunsan.deepspeed.utils.logging import log_dist

__all__ = ["set_random_seed", "see_memory_usage"]


def set_random_seed(seed: int) -> None:
    """Python's, numpy's and torch's generators (every device's), as DeepSpeed's."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    if not force:
        return
    if torch.cuda.is_available():
        log_dist(f"{message} | allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, max "
                 f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    else:
        log_dist(f"{message} | (CPU: no device memory to report)")
