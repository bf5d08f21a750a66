"""ZeRO-3's frozen parameters (a LoRA base): sharded at rest like the trained ones, with no gradient and no
optimizer state.

They get a layout of their own, one bucket per unit in the units' order, so the trained layout (and with it
the gradient shard, the optimizer and checkpoints of what trains) holds the adapters only. A unit is
gathered as two all-gathers launched together, and released with them. The frozen part may be needed
after the unit's last trained gradient exists (a base weight's input gradient is its own autograd node),
so the strategy releases it only when the gradient has left the unit (see FullyShardedDP.pre_backward).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from bunsan.zero.layout import ShardLayout
from bunsan.zero.materialize import replace_meta_parameters, unit_full_weights
from bunsan.zero.unit_buffer import UnitBuffer


class FrozenShards:
    def __init__(self, module: nn.Module, groups: list[list[nn.Parameter]], comm, group, device: torch.device,
                 home: torch.device, dtype: torch.dtype, seed: int, pin_memory: bool = False):
        self.comm, self.group, self.device, self.dtype = comm, group, device, dtype
        self.params = [p for g in groups for p in g]
        index, start = [], 0
        for g in groups:
            index.append(list(range(start, start + len(g))))
            start += len(g)
        self.layout = ShardLayout(self.params, index, group.size, group.rank)
        names = {p: name for name, p in module.named_parameters(remove_duplicate=True)}
        self.names = [names[p] for p in self.params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.slices = self.layout.shard_slices()
        # (pinned where the trained shards are: the gathers' copies from the host then run asynchronously; these
        # shards are never written after, so no copy can race a write)
        self.shard = torch.empty(self.layout.shard_numel, dtype=dtype, device=home, pin_memory=pin_memory)
        meta = any(p.is_meta for p in self.params)
        for k, (lo, hi, s) in enumerate(self.slices):
            if not self.layout.buckets[k].size:
                continue
            full = unit_full_weights(module, self.layout, k, self.params, self.names, dtype, device, seed, meta)
            comm.broadcast(full, 0, group)     # identical on every rank, whatever each built
            b = self.layout.buckets[k]
            self.shard[s:s + hi - lo].copy_(full[lo - b.start:hi - b.start])
            del full
        if meta:
            self.params = replace_meta_parameters(module, self.params, device, dtype)
        self.bufs = []
        for b in self.layout.buckets:
            buf = UnitBuffer(b.size, dtype, device)
            for i in b.params:
                self.params[i].data = buf.view(self.layout.offsets[i] - b.start, self.layout.numels[i],
                                               self.shapes[i])
            buf.free()
            self.bufs.append(buf)

    def size(self, k: int) -> int:
        return self.layout.buckets[k].size

    def launch_gather(self, k: int):
        """Start gathering unit k's frozen part; returns the handle (None when the unit has none)."""
        if not self.size(k):
            return None
        lo, hi, s = self.slices[k]
        return self.bufs[k].gather(self.comm, self.shard[s:s + hi - lo].to(self.device, non_blocking=True),
                                   self.group)

    def free(self, k: int) -> None:
        self.bufs[k].free()

    def resident_bytes(self, k: int) -> int:
        return self.bufs[k].resident_bytes()

    def holds(self, param) -> int | None:
        """The unit whose frozen part holds `param`, or None."""
        for k, b in enumerate(self.layout.buckets):
            if any(self.params[i] is param for i in b.params):
                return k
        return None

    def fragments(self):
        """(parameter index, first element, this rank's flat slice of it): what a checkpoint writes and reads."""
        for f in self.layout.fragments:
            yield f.param, f.param_offset, self.shard[f.shard_offset:f.shard_offset + f.numel]
