"""ZeRO stage 3: parameters sharded at rest, gathered one unit at a time.

A *unit* is a group of parameters gathered and released together: each
transformer block (`model.layers[i]`) by default, or the modules whose class names
are listed in `zero_optimization.stage3_unit_modules`; the parameters left over
(embedding, final norm, head) form the root unit, gathered for the whole step.

    forward:   pre-hook gathers unit i (waits for its prefetch), prefetches i+1;
               post-hook releases unit i and marks its output so that ...
    backward:  ... the gradient reaching that output first re-gathers unit i and
               prefetches i-1; once all of unit i's gradients exist they are copied
               into a bucket, freed, reduce-scattered into the fp32 gradient shard,
               and unit i is released again.

A released parameter's `.data` is an empty tensor; autograd keeps the parameter
object itself, so re-pointing `.data` at a fresh gather is what backward sees.
Units of at most `stage3_param_persistence_threshold` elements stay gathered; the next unit is prefetched
whenever `stage3_max_live_parameters` allows, whatever its size (`stage3_prefetch_bucket_size: 0` turns
prefetch off): with a block of a 1B+ model above DeepSpeed's 5e7-element bucket, a size cap would leave every
gather exposed. With `offload_param` and `pin_memory` on a GPU, the shards' host memory is pinned, so the
gathers' host-to-device copies run asynchronously; a write-back into a shard waits for the copy that read it.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from bunsan.comm.collectives import all_reduce_on
from bunsan.optim.optimizers import group_indices
from bunsan.zero.strategy import Sharded
from bunsan.zero.buckets import BucketHooks
from bunsan.zero.layout import ShardLayout
from bunsan.zero.host_buffer import TRIM_EVERY, trim_heap
from bunsan.zero.frozen import FrozenShards
from bunsan.zero.materialize import replace_meta_parameters, unit_full_weights
from bunsan.zero.offload import CopyMarks
from bunsan.zero.optimizer import ShardedOptimizer
from bunsan.zero.reduce import ShardReducer
from bunsan.zero.stage3_pipeline import PipelineSchedule
from bunsan.zero.unit_buffer import UnitBuffer
from bunsan.zero.units import PreBackward, Unit, UnitHandles, find_units
from bunsan.zero.swap import SwapFile


class FullyShardedDP(PipelineSchedule, Sharded):
    stage = 3

    def __init__(self, trainable, comm, group, cfg, dims, module: nn.Module, opt_spec, device):
        super().__init__(trainable, comm, group, cfg.zero_optimization, dims, module)
        self.device, self.module = device, module
        self.holding = False      # a pipeline schedule with stage3_pipeline_gather "schedule": nothing released
        self.schedule_grads = None
        self._trim = self.zero.trim_host_memory and device.type == "cpu"
        self._released = 0
        order = self._make_units(trainable, module)
        self._shard_parameters(module, cfg, order)
        self._make_optimizer(opt_spec)
        zero = self.zero
        self.reducer = ShardReducer(self.layout, comm, group, self.dtype, self.opt, zero,
                                    after_launch=self._after_reduce)
        self.reducer.device = device
        self.hooks = BucketHooks(self.params, [b.params for b in self.layout.buckets], self.reducer.launch,
                                 on_grad=self.reducer.stage_grad, overlap=zero.overlap_comm)
        self._install_hooks(module)

    def _make_units(self, trainable: list, module: nn.Module) -> list:
        """The units (blocks named in stage3_unit_modules, then the root of what is left) in backward order,
        and self.params in unit order; returns [(module or None, its parameter indices)]."""
        zero = self.zero
        n, r = self.group.size, self.group.rank
        unit_modules = find_units(module, list(zero.stage3_unit_modules))
        index = {p: i for i, p in enumerate(trainable)}
        in_unit, unit_params = set(), []
        for m in unit_modules:
            members = [index[p] for p in m.parameters() if p in index and index[p] not in in_unit]
            in_unit.update(members)
            unit_params.append(members)
        root = [i for i in range(len(trainable)) if i not in in_unit]
        total = sum(p.numel() for p in trainable)
        in_root = sum(trainable[i].numel() for i in root)
        if total > 1_000_000 and in_root > 0.5 * total:   # (a tiny model's embedding may outweigh its blocks)
            warnings.warn(f"ZeRO-3 on {type(module).__name__}: the root unit (the parameters outside its "
                          f"{len(unit_modules)} blocks) holds {in_root / total:.0%} of them and is gathered whole "
                          "through every step, so ZeRO-3 saves little; name the block class in "
                          "zero_optimization.stage3_unit_modules", stacklevel=4)
        # Buckets in backward order (last block first, root last): gradients are reduced in that order.
        order = [(m, ps) for m, ps in zip(unit_modules, unit_params)][::-1] + [(None, root)]
        self.units = [Unit(m, ps) for m, ps in order]
        path = {m: n for n, m in module.named_modules()}
        self.unit_names = [path.get(m, "root") if m is not None else "root" for m, _ in order]
        self.current_unit = None
        self.forward_order = list(range(len(unit_modules)))[::-1]   # unit indices, first block first
        self.params = [trainable[i] for _, ps in order for i in ps]
        remap = {old: new for new, old in enumerate(i for _, ps in order for i in ps)}
        for u in self.units:
            u.params = [remap[i] for i in u.params]
        self.layout = ShardLayout(self.params, [u.params for u in self.units], n, r)
        names = {p: name for name, p in module.named_parameters(remove_duplicate=True)}
        self.names = [names[p] for p in self.params]
        self._param_shapes = [tuple(p.shape) for p in self.params]
        self._built_params = list(self.params)    # the user's optimizer groups name these (meta ones are replaced)

        return order

    def _shard_parameters(self, module: nn.Module, cfg, order: list) -> None:
        """This rank's shard of every unit, materialised one unit at a time; frozen weights sharded alike;
        each parameter a view into its unit's (released) gather buffer."""
        zero, comm, group, device = self.zero, self.comm, self.group, self.device
        frozen = [p for p in module.parameters() if not p.requires_grad]
        off_p = zero.offload_param
        self.param_home = torch.device("cpu") if off_p and off_p.device != "none" else device
        self.pinned = bool(off_p and off_p.device != "none" and off_p.pin_memory and device.type == "cuda")
        self.param_shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.param_home,
                                       pin_memory=self.pinned and off_p.device == "cpu")
        # host->device copies of host shards still in flight, per unit (shards on the device need no marks)
        self.copies = CopyMarks(device if self.param_home.type == "cpu" else torch.device("cpu"))
        self.slices = self.layout.shard_slices()
        meta = any(p.is_meta for p in self.params)
        for k, u in enumerate(self.units):
            full = unit_full_weights(module, self.layout, k, self.params, self.names, self.dtype, device,
                                     cfg.train.seed, meta)
            comm.broadcast(full, 0, group)      # identical start on every rank, whatever each built
            lo, hi, s = self.slices[k]
            b = self.layout.buckets[k]
            self.param_shard[s:s + hi - lo].copy_(full[lo - b.start:hi - b.start])
            del full
        self.param_swap = None
        if off_p is not None and off_p.device == "nvme":   # parameter shards live on disk between uses
            self.param_swap = SwapFile(off_p.nvme_path, f"params-rank{comm.global_rank}",
                                       pinned_buffers=off_p.buffer_count if self.pinned else 0)
            for k, (lo, hi, s) in enumerate(self.slices):
                self.param_swap.write(f"u{k}", self.param_shard[s:s + hi - lo])
        self._dirty: dict[int, torch.Tensor] = {}
        self.frozen_shards = None
        if frozen:   # LoRA's base, a frozen encoder: sharded too, in units matching the trained ones; a weight of
            # nested units (Qwen2-Audio's attention, listed inside its listed layers) in the outer one only, as a
            # trained one is (_make_units), not held and gathered twice
            held, taken, claimed = set(frozen), set(), {}
            for m, _ in reversed(order[:-1]):            # (order is backward: this is the units' forward order)
                claimed[m] = [p for p in m.parameters() if p in held and p not in taken]
                taken.update(claimed[m])
            unit_frozen = [claimed[m] for m, _ in order[:-1]]
            unit_frozen.append([p for p in frozen if p not in taken])
            self.frozen_shards = FrozenShards(module, unit_frozen, comm, group, device, self.param_home, self.dtype,
                                       cfg.train.seed, pin_memory=self.pinned and off_p.device == "cpu")
        if meta:
            self.params = replace_meta_parameters(module, self.params, device, self.dtype)
        for k, u in enumerate(self.units):   # (LoRA: a unit may hold no trained weight, only frozen ones)
            u.buf = UnitBuffer(self.layout.buckets[k].size, self.dtype, device)
            start = self.layout.buckets[k].start
            for i in u.params:   # views first: slicing checks the storage's size
                self.params[i].data = u.buf.view(self.layout.offsets[i] - start, self.layout.numels[i],
                                                 self._param_shapes[i])
            u.buf.free()
        for k, u in enumerate(self.units):
            u.persistent = self._size(k) <= zero.stage3_param_persistence_threshold


    def _make_optimizer(self, opt_spec) -> None:
        """The sharded optimizer over the parameter shards (an fp32 model in memory is its own master)."""
        zero, comm, group, device = self.zero, self.comm, self.group, self.device
        off_o = zero.offload_optimizer
        cls, defaults, groups = opt_spec
        groups = group_indices(groups, self._built_params)
        self._built_params = None
        alias = not self.mixed and self.param_swap is None
        self.opt = self.optimizer = ShardedOptimizer(
            self.layout, cls, defaults, groups, device, self.dtype,
            master_alias=self.param_shard if alias else None, alias_by="shard",
            init_shard=self.param_shard, offload=off_o.device if off_o else "none",
            nvme_path=off_o.nvme_path if off_o else None, sub_group_size=int(zero.sub_group_size),
            rank=comm.global_rank, pin_memory=bool(off_o and off_o.pin_memory), shapes=self._param_shapes,
            all_reduce=all_reduce_on(comm, group, device))
        if self.param_swap is not None:
            self.param_shard = None

    # -- gather / release ------------------------------------------------------------------------
    def _size(self, k: int) -> int:
        """Elements of unit k gathered: trained and frozen."""
        return self.layout.buckets[k].size + (self.frozen_shards.size(k) if self.frozen_shards is not None else 0)

    def unit_shard(self, k: int) -> torch.Tensor:
        """This rank's slice of unit k, wherever it lives (device, host, or the NVMe swap file)."""
        lo, hi, s = self.slices[k]
        if self.param_swap is None:
            return self.param_shard[s:s + hi - lo]
        if k not in self._dirty:
            return self.param_swap.read(f"u{k}", hi - lo, self.dtype)
        return self._dirty[k]

    def _launch_gather(self, k: int):
        handles = [self.frozen_shards.launch_gather(k)] if self.frozen_shards is not None else []
        if self.layout.buckets[k].size:
            mine = self.unit_shard(k).to(self.device, non_blocking=True)
            self.copies.copied(k)     # (pinned host memory: the copy runs on; the next write of it waits)
            if self.param_swap is not None:
                self.param_swap.copied()
            handles.append(self.units[k].buf.gather(self.comm, mine, self.group))
        return UnitHandles([h for h in handles if h is not None])

    def gather(self, k: int) -> None:
        u = self.units[k]
        self.current_unit = self.unit_names[k]     # where an out-of-memory failure happened (the doctor)
        if u.gathered:
            return
        handle = u.pending if u.pending is not None else self._launch_gather(k)
        u.pending = None
        handle.wait()
        u.gathered = True

    def release(self, k: int, force: bool = False) -> None:
        u = self.units[k]
        if not u.gathered or ((u.persistent or self.holding) and not force):
            return
        u.buf.free()
        if self.frozen_shards is not None:
            self.frozen_shards.free(k)
        u.gathered = False
        self._released += 1
        if self._trim and self._released % TRIM_EVERY == 0:
            trim_heap()

    def prefetch(self, k: int) -> None:
        u = self.units[k]
        size = self._size(k)
        if u.gathered or u.pending is not None or not self.zero.stage3_prefetch_bucket_size:
            return
        live = sum(self._size(j) for j, v in enumerate(self.units) if v.gathered or v.pending is not None)
        if live + size <= self.zero.stage3_max_live_parameters:
            u.pending = self._launch_gather(k)

    def resident_bytes(self, param: torch.Tensor) -> int:
        """Bytes of the buffer of the unit holding `param` that occupy memory now (0 when released)."""
        k = self.frozen_shards.holds(param) if self.frozen_shards is not None else None
        if k is not None:
            return self.frozen_shards.resident_bytes(k)
        u = next(u for u in self.units if any(self.params[i] is param for i in u.params))
        return u.buf.resident_bytes()

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        return self._param_shapes

    @contextlib.contextmanager
    def gathered(self):
        """All parameters gathered (to read, save or inspect them outside forward); released after."""
        for k in range(len(self.units)):
            self.gather(k)
        held, self.holding = self.holding, True   # forward passes inside (generation) keep them gathered
        try:
            yield
        finally:
            self.holding = held
            for k in range(len(self.units)):
                self.release(k)

    # -- hooks -----------------------------------------------------------------------------------
    def _install_hooks(self, module: nn.Module) -> None:
        root = len(self.units) - 1
        module.register_forward_pre_hook(lambda m, a: self._root_pre())
        module.register_forward_hook(lambda m, a, out: self._root_post())
        for pos, k in enumerate(self.forward_order):
            nxt = self.forward_order[pos + 1] if pos + 1 < len(self.forward_order) else None
            self.units[k].module.register_forward_pre_hook(lambda m, a, k=k, nxt=nxt: self._pre_forward(k, nxt))
            self.units[k].module.register_forward_hook(lambda m, a, out, k=k: self._post_forward(k, out))
        self._root = root

    def _root_pre(self) -> None:
        self.gather(self._root)
        if self.forward_order:
            self.prefetch(self.forward_order[0])

    def _root_post(self) -> None:
        if not torch.is_grad_enabled():
            self.release(self._root)

    def _pre_forward(self, k: int, nxt: int | None) -> None:
        self.gather(k)
        if nxt is not None and not self.units[k].in_backward:
            self.prefetch(nxt)

    def _post_forward(self, k: int, out):
        u = self.units[k]
        if u.in_backward:              # activation-checkpoint recompute inside backward: keep it
            return out
        if not torch.is_grad_enabled():
            self.release(k)
            return out
        self.release(k)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            return PreBackward.apply(self, k, out)
        if isinstance(out, tuple):
            return tuple(PreBackward.apply(self, k, t) if isinstance(t, torch.Tensor) and t.requires_grad else t
                         for t in out)
        return out

    def pre_backward(self, k: int) -> None:
        self.units[k].in_backward = True
        self.gather(k)
        pos = self.forward_order.index(k)
        if pos > 0:
            self.prefetch(self.forward_order[pos - 1])
        if pos + 1 < len(self.forward_order) and self._holds_frozen(self.forward_order[pos + 1]):
            # The gradient reached this unit's output, the next unit's input: that unit's backward is over.
            self.release(self.forward_order[pos + 1])

    def _holds_frozen(self, k: int) -> bool:
        return self.frozen_shards is not None and self.frozen_shards.size(k) > 0

    def _after_reduce(self, k: int) -> None:
        self.units[k].in_backward = False
        # The root stays gathered until the step is done. A unit with frozen weights may still need them for
        # its input's gradient after its last trained gradient: pre_backward of the unit before releases it.
        if k != self._root and not self._holds_frozen(k):
            self.release(k)

    # -- the step --------------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        self.hooks.begin()             # gradients are reduced on every micro-step into the fp32 shard

    def end_backward(self, sync: bool) -> None:
        self.hooks.finish()
        self.reducer.drain()
        for k, u in enumerate(self.units):
            u.in_backward = False
            self.release(k)

    def _write_back(self, f, values: torch.Tensor) -> None:
        k = self.reducer.bucket_of[f.param]
        self.copies.before_write(k)
        if self.param_swap is None:
            self.param_shard[f.shard_offset:f.shard_offset + f.numel].copy_(values)
            return
        if k not in self._dirty:
            self._dirty[k] = self.unit_shard(k).clone()
        s = self.slices[k][2]
        self._dirty[k][f.shard_offset - s:f.shard_offset - s + f.numel].copy_(values)

    def step(self) -> None:
        for k in range(len(self.units)):
            self.release(k, force=True)   # persistent units are re-gathered with the new weights
        self.opt.step(self._write_back)
        for k, shard in self._dirty.items():
            self.param_swap.write(f"u{k}", shard)
        self._dirty.clear()
        if self._trim:     # backward's freed activations and gradients: pages back before the next forward
            trim_heap()

    def zero_grad(self) -> None:
        self.opt.drop_grad()

    def sync_params_from_master(self) -> None:
        for k in range(len(self.units)):
            self.release(k, force=True)   # gathered copies (persistent units) would be stale
        if not self.opt.aliased:
            self.opt.visit(lambda j, master, state: self._write_back(self.layout.fragments[j], master))
        for k, shard in self._dirty.items():
            self.param_swap.write(f"u{k}", shard)
        self._dirty.clear()

    def consolidated_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        with self.gathered():
            return super().consolidated_state_dict(module)

    def bytes_by_kind(self) -> dict:
        item = self.dtype.itemsize
        gathered = sum(self._size(k) for k, u in enumerate(self.units) if u.gathered) * item
        params = self.param_shard.numel() * item if self.param_shard is not None else 0
        if self.frozen_shards is not None:
            params += self.frozen_shards.shard.numel() * item
        out = {"params": params + gathered, "grads": self.layout.shard_numel * 4, **self.opt.bytes_by_kind()}
        if self.param_swap is not None:
            out["disk"] += self.param_swap.size()
        off = self.zero.offload_param
        if off is not None and off.device != "none":
            out["host"] += params
        return out
