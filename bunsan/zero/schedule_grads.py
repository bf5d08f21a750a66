"""Whole gradients through a pipeline schedule (ZeRO-2 and -3 under pipeline stages), in one flat buffer laid
out as the reduce buckets are: reduce-scattered bucket by bucket once the schedule is over, then dropped, so
the optimizer step and the next forward run without them.

One buffer rather than autograd's tensor per parameter: the per-parameter tensors, allocated and freed every
step, fragment the allocator (a higher peak than ZeRO-1's flat buffer), and a flat buffer is what the
reduce-scatter reads anyway. On the host its pages are dropped after the reduce (they read as zeros when the
next schedule writes them); on a GPU the buffer is freed and made again. The sum over the schedule's
micro-batches is in the model's dtype, as ZeRO-1's flat gradients are under a pipeline (without one, ZeRO-2/3
add each micro-step into the fp32 shard): bf16 and fp16 sum their micro-batches at 16 bits here.
"""

from __future__ import annotations

import torch

from bunsan.zero.host_buffer import HostBuffer

__all__ = ["ScheduleGrads"]


class ScheduleGrads:
    def __init__(self, layout, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        self.layout, self.shapes, self.dtype, self.device = layout, shapes, dtype, device
        self.host = HostBuffer(layout.total, dtype) if device.type == "cpu" else None
        self.flat: torch.Tensor | None = self.host.tensor if self.host is not None else None

    def attach(self, params: list) -> None:
        """Point every parameter's .grad at its place in the buffer (autograd accumulates there)."""
        if self.flat is None:
            self.flat = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        for i, p in enumerate(params):
            off, n = self.layout.offsets[i], self.layout.numels[i]
            p.grad = self.flat[off:off + n].view(self.shapes[i])

    def reduce_and_drop(self, params: list, reducer) -> None:
        """Every bucket reduce-scattered in order from the buffer; then the buffer dropped."""
        for k, b in enumerate(self.layout.buckets):
            reducer.launch(k, full=self.flat[b.start:b.start + b.size])
        reducer.drain()
        for p in params:
            p.grad = None
        if self.host is not None:
            self.host.release()
        else:
            self.flat = None
