"""`deepspeed.moe.layer.MoE`: not built in bunsan; constructing one is a clear error."""

from __future__ import annotations

__all__ = ["MoE"]


class MoE:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("deepspeed.moe.layer.MoE: bunsan has no mixture-of-experts layers (no expert "
                                  "parallelism); use a dense feed-forward layer")
