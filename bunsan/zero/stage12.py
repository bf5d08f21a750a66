"""ZeRO stages 1 and 2: optimizer states (stage 1) and gradients too (stage 2) sharded over data-parallel ranks.

Stage 1: full gradients accumulate in a flat buffer as in stage 0; on the last
micro-step each bucket is reduce-scattered (from backward hooks, overlapped) and
this rank keeps its slice, in fp32, for the step.

Stage 2: no full gradient buffer. On every micro-step each parameter's gradient is
copied into its bucket as soon as autograd produces it and freed; a full bucket
is reduce-scattered at once and the rank's slice is added to a persistent fp32
gradient shard. At most two buckets are in flight, so full-size gradients never
exist beyond two buckets.

Under a pipeline both accumulate whole gradients through the schedule and reduce
them once after it (strategy.py); stage 2 frees them then.

Both: each rank steps only its shard (optimizer.py), writes the updated slice
into the flat parameters, and the buckets are all-gathered.
"""

from __future__ import annotations

import torch

from bunsan.comm.collectives import all_reduce_on
from bunsan.optim.optimizers import group_indices
from bunsan.zero.strategy import Sharded
from bunsan.zero.buckets import BucketHooks, FlatParams
from bunsan.zero.host_buffer import TRIM_EVERY
from bunsan.zero.layout import ShardLayout
from bunsan.zero.optimizer import ShardedOptimizer
from bunsan.zero.reduce import ShardReducer
from bunsan.zero.schedule_grads import ScheduleGrads


class ShardedGrads(Sharded):
    """What stages 1 and 2 share: the buckets, the sharded optimizer, the reducer and the all-gather after
    the step. The subclasses differ in where a micro-step's gradients go (Stage1, Stage2 below)."""

    keeps_full_grads: bool       # stage 1: a flat gradient buffer through backward; stage 2: none
    trims_host_memory: bool      # heap trims in backward (see Stage2)

    def __init__(self, params, comm, group, zero_cfg, dims, module, opt_spec, device):
        super().__init__(params, comm, group, zero_cfg, dims, module)
        n, r = group.size, group.rank
        buckets = ShardLayout.greedy_buckets([p.numel() for p in self.params], int(zero_cfg.reduce_bucket_size))
        self.layout = ShardLayout(self.params, buckets, n, r)
        self.flat = FlatParams(self.params, self.layout, with_grads=self.keeps_full_grads)
        comm.broadcast(self.flat.data, 0, group)
        self.slices = self.layout.shard_slices()
        off = zero_cfg.offload_optimizer
        cls, defaults, groups = opt_spec
        groups = group_indices(groups, self.params)
        self.opt = self.optimizer = ShardedOptimizer(
            self.layout, cls, defaults, groups, device, self.dtype,
            master_alias=None if self.mixed else self.flat.data,
            init_shard=torch.cat([self.flat.data[lo:hi] for lo, hi, _ in self.slices]),
            offload=off.device if off else "none", nvme_path=off.nvme_path if off else None,
            sub_group_size=int(zero_cfg.sub_group_size), rank=comm.global_rank,
            pin_memory=bool(off and off.pin_memory), shapes=[tuple(p.shape) for p in self.params],
            all_reduce=all_reduce_on(comm, group, device), cuts=tuple(s for _, _, s in self.slices))
        # The fp32 gradient shard exists only from the first reduce to the step (made by the reducer, freed
        # by zero_grad), so it is not held through forward and the loss, where activations peak.
        self.opt.drop_grad()
        trim = zero_cfg.trim_host_memory and device.type == "cpu" and self.trims_host_memory
        self.reducer = ShardReducer(self.layout, comm, group, self.dtype, self.opt, zero_cfg,
                                    source=self._flat_bucket if self.keeps_full_grads else None,
                                    trim_every=TRIM_EVERY if trim else 0)
        self.reducer.device = self.flat.data.device
        self.hooks = BucketHooks(self.params, [b.params for b in self.layout.buckets], self.reducer.launch,
                                 on_grad=None if self.keeps_full_grads else self.reducer.stage_grad,
                                 overlap=zero_cfg.overlap_comm)

    def _flat_bucket(self, k: int) -> torch.Tensor:
        b = self.layout.buckets[k]
        return self.flat.grad[b.start:b.start + b.size]

    def end_backward(self, sync: bool) -> None:
        self.hooks.finish()
        self.reducer.drain()

    # -- the step --------------------------------------------------------------------------------
    def _write_back(self, f, values: torch.Tensor) -> None:
        self.flat.data[f.flat_offset:f.flat_offset + f.numel].copy_(values)

    def step(self) -> None:
        gather = _Gather(self)
        self.opt.step(self._write_back, after=gather.stepped_below)   # each bucket leaves once stepped
        gather.finish()
        # No heap trim here: the pages backward's trims left are reused by the next forward, and returning
        # them would only fault them back in.

    def sync_params_from_master(self) -> None:
        if not self.opt.aliased:
            self.opt.visit(lambda j, master, state: self._write_back(self.layout.fragments[j], master))
        _Gather(self).finish()

    def zero_grad(self) -> None:
        self.opt.drop_grad()

    def bytes_by_kind(self) -> dict:
        return {"params": self.flat.data.numel() * self.flat.data.element_size(), "grads": self._grad_bytes(),
                **self.opt.bytes_by_kind()}


class Stage1(ShardedGrads):
    """Optimizer states sharded; full gradients accumulate as in stage 0 and are reduce-scattered on the last
    micro-step only."""

    stage = 1
    keeps_full_grads = True
    # A trim in backward would return just the activation pages the next forward faults back in: the full
    # gradient buffer, held through backward, is what sets the peak.
    trims_host_memory = False

    def begin_backward(self, sync: bool) -> None:
        if not self.flat.grads_attached():
            self.flat.attach()
        if sync:
            self.hooks.begin()

    def end_backward(self, sync: bool) -> None:
        if sync:
            super().end_backward(sync)

    def zero_grad(self) -> None:
        # Zeroed in place, not dropped (flat.zero_grad()): dropping would fault 4Ψ bytes of pages back in
        # every backward, and the ZeRO formula counts these gradients as held.
        self.flat.grad.zero_()
        super().zero_grad()

    def _grad_bytes(self) -> int:
        return self.flat.grad.numel() * self.flat.grad.element_size()


class Stage2(ShardedGrads):
    """Gradients sharded too: every micro-step reduces into the persistent fp32 gradient shard."""

    stage = 2
    keeps_full_grads = False
    trims_host_memory = True     # no full gradient buffer: trims lower the peak for little cost

    def begin_backward(self, sync: bool) -> None:
        self.hooks.begin()

    # Under a pipeline the gradients accumulate whole through the schedule (zero/schedule_grads.py) and are
    # reduce-scattered once after it.
    schedule_grads = None

    def begin_schedule(self) -> None:
        if self.schedule_grads is None:
            self.schedule_grads = ScheduleGrads(self.layout, [tuple(p.shape) for p in self.params], self.dtype,
                                                self.flat.data.device)
        self.schedule_grads.attach(self.params)

    def end_schedule(self) -> None:
        self.schedule_grads.reduce_and_drop(self.params, self.reducer)

    def _grad_bytes(self) -> int:
        return self.layout.shard_numel * 4    # the fp32 gradient shard, counted during backward and the step


class _Gather:
    """All-gathers the buckets, in order, as their slices are stepped; at most allgather_bucket_size elements
    in flight. Every rank launches the same buckets in the same order, whatever its sub-groups."""

    def __init__(self, owner: ShardedGrads):
        self.o = owner
        self.next, self.pending, self.in_flight = 0, [], 0

    def stepped_below(self, shard_offset: int) -> None:
        o = self.o
        while self.next < len(o.slices):
            lo, hi, s = o.slices[self.next]
            if s + hi - lo > shard_offset:
                return
            b = o.layout.buckets[self.next]
            mine = o.flat.data[lo:hi]     # gathered in place: it is this rank's chunk of the bucket
            self.pending.append(o.comm.all_gather(o.flat.data[b.start:b.start + b.size], mine, o.group,
                                                  async_op=True))
            self.in_flight += b.size
            self.next += 1
            if self.in_flight >= int(o.zero.allgather_bucket_size):
                self._wait()

    def _wait(self) -> None:
        for h in self.pending:
            h.wait()
        self.pending, self.in_flight = [], 0

    def finish(self) -> None:
        self.stepped_below(1 << 62)
        self._wait()
