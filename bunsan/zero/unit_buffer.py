"""One ZeRO-3 unit's gathered storage, kept for the unit's whole life: its parameters are views of it.

Releasing frees the memory but keeps the buffer (on CUDA the storage is resized to 0 bytes, as FSDP1 does;
on CPU the pages of a mapping are dropped, see host_buffer.py): autograd may keep views of a weight (W.t()
in a matmul) until backward, and those views must not pin a stale copy of the unit. A unit's trained and
frozen (LoRA base) parts each have one (stage3.py, frozen.py); either may be empty.
"""

from __future__ import annotations

import torch

from bunsan.zero.host_buffer import HostBuffer


class UnitBuffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.host = HostBuffer(size, dtype) if device.type == "cpu" and size else None
        self.tensor = self.host.tensor if self.host is not None else torch.empty(size, dtype=dtype, device=device)

    def view(self, offset: int, numel: int, shape) -> torch.Tensor:
        return self.tensor[offset:offset + numel].view(shape)

    def gather(self, comm, shard: torch.Tensor, group):
        """Start filling the buffer with every rank's `shard`; the handle, or None for an empty buffer."""
        if not self.tensor.numel():
            return None
        if self.host is None:
            self.tensor.untyped_storage().resize_(self.tensor.numel() * self.tensor.element_size())
        # .data: a separate version counter, so filling the buffer does not look like an in-place change to
        # the weights autograd saved for backward.
        return comm.all_gather(self.tensor.data, shard, group, async_op=True)

    def free(self) -> None:
        if not self.tensor.numel():
            return
        if self.host is not None:
            self.host.release()
        else:
            self.tensor.untyped_storage().resize_(0)

    def resident_bytes(self) -> int:
        if self.host is not None:
            return self.host.resident_bytes()
        return self.tensor.untyped_storage().nbytes()
