"""ZeRO: shard optimizer states (stage 1), gradients (2) and parameters (3) over the data-parallel ranks."""

from __future__ import annotations

import torch

from bunsan.optim.optimizers import build_optimizer, optimizer_spec
from bunsan.zero.strategy import OtherDims, Strategy

__all__ = ["Init", "OtherDims", "Strategy", "make_strategy"]


class Init:
    """Build a model without allocating it: `with bunsan.zero.Init(): model = Llama(cfg)`.

    Parameters are created on the meta device; `bunsan.initialize` with ZeRO stage 3
    then materialises each rank's shard only, one unit at a time, so no rank ever
    holds the whole model. bunsan's models fill each tensor by name (`init_parameter`);
    a Hugging Face model is initialised at the end of the block by its own
    `_init_weights`, one block at a time, each rank keeping its slice, with the values
    of a normal build for the same seed (zero/hf_init.py). Accepts (and ignores)
    DeepSpeed's zero.Init arguments.
    """

    def __init__(self, *args, **kwargs):
        self._ctx = torch.device("meta")
        self._hf = None

    def __enter__(self):
        from bunsan.zero.hf_init import HFReplay
        self._ctx.__enter__()
        self._hf = HFReplay().__enter__()
        return self

    def __exit__(self, *exc):
        self._hf.__exit__(*exc)
        self._ctx.__exit__(*exc)
        if exc[0] is None:
            self._hf.finish()
        return False


def make_strategy(trainable, comm, group, cfg, device, user_optimizer, module, dims: OtherDims):
    """The data-parallel strategy for `zero_optimization.stage` over `trainable` (parameters of `module`)."""
    from bunsan.zero.stage0 import Replicated
    zero = cfg.zero_optimization
    stage = zero.stage
    if stage >= 2 and not zero.contiguous_gradients:
        raise ValueError("zero_optimization.contiguous_gradients=false: bunsan always copies gradients into "
                         "contiguous buckets at stages 2-3; remove the key or set it to true")
    if not zero.allgather_partitions:
        raise ValueError("zero_optimization.allgather_partitions=false (broadcast-based gathering) is not "
                         "supported; remove the key or set it to true")
    if any(p.is_meta for p in trainable) and stage < 3:
        raise ValueError("parameters on the meta device (bunsan.zero.Init) need zero_optimization.stage 3")
    if stage == 0:
        return Replicated(trainable, comm, group, zero, dims, module, lambda ps: build_optimizer(ps, cfg.optimizer, device),
                          user_optimizer)
    spec = optimizer_spec(user_optimizer, cfg.optimizer, trainable, device)
    if stage in (1, 2):
        from bunsan.zero.stage12 import Stage1, Stage2
        return (Stage1 if stage == 1 else Stage2)(trainable, comm, group, zero, dims, module, spec, device)
    from bunsan.zero.stage3 import FullyShardedDP
    return FullyShardedDP(trainable, comm, group, cfg, dims, module, spec, device)
