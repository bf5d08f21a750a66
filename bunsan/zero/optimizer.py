"""The sharded optimizer of ZeRO stages 1-3: master weights and optimizer states for this rank's shard only.

The shard is a list of fragments (the parts of parameters inside this rank's
slices, see layout.py). Each fragment is one tensor the torch optimizer steps;
they are views into a master buffer (fp32, the rank's shard) and their grads are
views into an fp32 gradient shard. Fragments are grouped into sub-groups of at
most `sub_group_size` elements, each with its own torch optimizer, so that with
NVMe offload only one sub-group's states are in memory at a time:

    for each sub-group: read states (+ master) from disk -> step -> write back -> free

Stages 1-2 also end sub-groups at bucket boundaries (`cuts`), so that each
bucket's all-gather can start as soon as its slice is stepped, while the next
slice steps.

With `offload_optimizer: cpu` the master and states live in host memory and the
step runs there; updated weights are cast and copied back to the device.
"""

from __future__ import annotations

import torch

from bunsan.optim.stepping import check_where, rebuild, stepping_of
from bunsan.zero.host_buffer import HostBuffer, trim_heap
from bunsan.zero.layout import ShardLayout
from bunsan.zero.swap import SwapFile


class SubGroup:
    def __init__(self, frags: list[int], lo: int, hi: int):
        self.frags, self.lo, self.hi = frags, lo, hi   # fragment indices; shard range [lo, hi)
        self.optimizer: torch.optim.Optimizer | None = None
        self.sources: list[int] = []      # the user's optimizer group of each of optimizer's groups
        self.swapped = False


class ShardedOptimizer:
    """Steps this rank's shard; the caller provides where the updated weights go."""

    def __init__(self, layout: ShardLayout, opt_class, defaults: dict, groups: list[tuple[list[int], dict]],
                 device: torch.device, model_dtype: torch.dtype, master_alias: torch.Tensor | None,
                 init_shard: torch.Tensor | None, offload: str = "none", nvme_path: str | None = None,
                 sub_group_size: int = 10**9, rank: int = 0, pin_memory: bool = False, alias_by: str = "flat",
                 shapes: list | None = None, all_reduce=None, cuts: tuple[int, ...] = ()):
        """
        groups: (parameter indices, hyperparameters) per optimizer param group.
        master_alias: fp32 storage the master may alias in place, else None: the flat parameters (stages 1-2,
            indexed by flat offsets) or the parameter shard (stage 3, indexed by shard offsets); see alias_by.
        init_shard: this rank's shard of the current weights (any dtype) to seed a separate master.
        shapes, all_reduce: every parameter's shape and a SUM over the data-parallel group, for Adafactor,
            whose statistics span whole rows and columns (adafactor.py).
        cuts: shard offsets where a sub-group must end (see step's `after`).
        """
        check_where(opt_class, zero_stage=1, tensor_parallel=False)   # (initialize checked the whole layout)
        self.factored = stepping_of(opt_class).kind == "factored"
        if self.factored:
            if offload == "nvme":
                raise ValueError("Adafactor with offload_optimizer.device=nvme: its row and column moments are not "
                                 "per element, which the NVMe swap of sub-groups assumes; use device cpu or none")
            sub_group_size = 1 << 62   # one optimizer per rank: its collectives line up with every other rank's
            cuts = ()
        self.layout, self.device, self.model_dtype = layout, device, model_dtype
        self.offload = offload
        self.home = torch.device("cpu") if offload in ("cpu", "nvme") else device
        self.opt_class, self.defaults = opt_class, defaults
        # fp32 weights that already live where the optimizer steps are their own master: no copy.
        self.aliased = master_alias is not None and master_alias.device == self.home and offload != "nvme"
        if self.aliased:
            self.master = master_alias
            key = (lambda f: f.flat_offset) if alias_by == "flat" else (lambda f: f.shard_offset)
            self._mview = lambda f: master_alias[key(f):key(f) + f.numel]
        else:
            self.master = init_shard.to(self.home, torch.float32, copy=True)
            if pin_memory and device.type == "cuda":
                self.master = self.master.pin_memory()
            self._mview = lambda f: self.master[f.shard_offset:f.shard_offset + f.numel]
        self.frag_tensors = [self._mview(f) for f in layout.fragments]
        self.grad = None          # the fp32 gradient shard: made by ensure_grad() at the first reduce
        self._grad_host = None
        group_of = {}
        for gi, (members, _) in enumerate(groups):
            for i in members:
                group_of[i] = gi
        # a parameter in no group is never stepped (as torch's optimizer would leave it): None
        self.group_of_frag = [group_of.get(f.param) for f in layout.fragments]
        self.groups = groups
        self._shapes, self._all_reduce = shapes, all_reduce
        self.subgroups = self._subgroups(sub_group_size, set(cuts))
        for sg in self.subgroups:
            sg.optimizer = self._build(sg)
        self.swap = None
        if offload == "nvme":
            self.swap = SwapFile(nvme_path, f"optimizer-rank{rank}")
            self._swap_out_all_masters()

    # -- construction ----------------------------------------------------------------------------
    def _subgroups(self, size: int, cuts: set[int]) -> list[SubGroup]:
        out, cur, lo = [], [], 0
        frags = self.layout.fragments
        for i, f in enumerate(frags):
            if cur and (f.shard_offset + f.numel - lo > size or f.shard_offset in cuts):
                out.append(SubGroup(cur, lo, f.shard_offset))
                cur, lo = [], f.shard_offset
            cur.append(i)
        if cur or not out:
            out.append(SubGroup(cur, lo, self.layout.shard_numel if not cur else
                                frags[cur[-1]].shard_offset + frags[cur[-1]].numel))
        return out

    def _build(self, sg: SubGroup) -> torch.optim.Optimizer:
        by_group: dict[int, list[torch.Tensor]] = {}
        for i in sg.frags:
            if self.group_of_frag[i] is not None:
                by_group.setdefault(self.group_of_frag[i], []).append(self.frag_tensors[i])
        pgroups = [{"params": ts, **self.groups[g][1]} for g, ts in sorted(by_group.items())]
        sg.sources = sorted(by_group)
        if not pgroups:  # a rank whose shard is all padding still needs an optimizer object
            pgroups = [{"params": [torch.zeros(0, device=self.home)], **self.groups[0][1]}]
            sg.sources = [0]
        if self.factored:
            from bunsan.zero.adafactor import ShardedAdafactor
            frags = self.layout.fragments
            where = {id(self.frag_tensors[i]): (frags[i].param, frags[i].param_offset) for i in sg.frags}
            return ShardedAdafactor(pgroups, where, self._shapes, self._all_reduce, **self.defaults)
        return rebuild(self.opt_class, pgroups, self.defaults)

    @property
    def param_groups(self) -> list[dict]:
        """The hyperparameters of every sub-group's groups (the engine writes lr here)."""
        return [g for sg in self.subgroups for g in sg.optimizer.param_groups]

    @property
    def group_sources(self) -> list[int]:
        """For each of param_groups, the index of the optimizer group (as the user built it) it is part of:
        this rank's shard holds pieces of some groups only, cut into sub-groups."""
        return [gi for sg in self.subgroups for gi in sg.sources]

    # -- NVMe swapping ---------------------------------------------------------------------------
    def _swap_out_all_masters(self) -> None:
        for k, sg in enumerate(self.subgroups):
            self.swap.write(f"master{k}", self.master[sg.lo:sg.hi])
        self.master = None  # lives on disk from now on
        for t in self.frag_tensors:
            t.data = torch.empty(0, dtype=torch.float32, device=self.home)

    def _swap_in(self, k: int, sg: SubGroup) -> torch.Tensor:
        master = self.swap.read(f"master{k}", sg.hi - sg.lo, torch.float32)
        for i in sg.frags:
            f = self.layout.fragments[i]
            self.frag_tensors[i].data = master[f.shard_offset - sg.lo:f.shard_offset - sg.lo + f.numel]
        if sg.swapped:
            for i in sg.frags:
                t = self.frag_tensors[i]
                for key, v in sg.optimizer.state[t].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        sg.optimizer.state[t][key] = self.swap.read(f"s{k}.{i}.{key}", t.numel(), v.dtype)
        return master

    def _swap_out(self, k: int, sg: SubGroup, master: torch.Tensor) -> None:
        self.swap.write(f"master{k}", master)
        for i in sg.frags:
            t = self.frag_tensors[i]
            for key, v in sg.optimizer.state[t].items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    self.swap.write(f"s{k}.{i}.{key}", v)
                    sg.optimizer.state[t][key] = torch.empty(0, dtype=v.dtype, device=self.home)
            t.data = torch.empty(0, dtype=torch.float32, device=self.home)
        sg.swapped = True

    # -- the step --------------------------------------------------------------------------------
    def step(self, write_back, after=None) -> None:
        """Step every sub-group; `write_back(fragment, fp32 values)` stores updated weights into the model;
        `after(shard offset)` is told, after each sub-group, that the shard below that offset is stepped."""
        self.ensure_grad()        # a step without a backward sees zero gradients
        for k, sg in enumerate(self.subgroups):
            master = self._swap_in(k, sg) if self.swap else None
            for i in sg.frags:
                f = self.layout.fragments[i]
                self.frag_tensors[i].grad = self.grad[f.shard_offset:f.shard_offset + f.numel]
            sg.optimizer.step()
            for i in sg.frags:
                self.frag_tensors[i].grad = None
            if not self.aliased:
                for i in sg.frags:
                    write_back(self.layout.fragments[i], self.frag_tensors[i])
            if self.swap:
                self._swap_out(k, sg, master)
            if after is not None:
                after(sg.hi)
        if self.swap:
            # the sub-groups' swapped-in masters and states are freed: hand their pages back, or glibc keeps
            # ~100 MiB of them (this suite's 20M model) resident into the next forward, above the estimate
            trim_heap()

    def ensure_grad(self) -> None:
        """The fp32 gradient shard (fragments get views of it while they step). On CPU it is a mapping
        whose zero pages become resident only as the reducer writes each bucket's slice, so during
        backward it grows bucket by bucket while activations shrink."""
        if self.grad is not None:
            return
        if self.home.type == "cpu":
            if self._grad_host is None:
                self._grad_host = HostBuffer(self.layout.shard_numel, torch.float32)
            self.grad = self._grad_host.tensor
        else:
            self.grad = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.home)

    def grad_pieces(self):
        """(parameter index, gradient view) of every fragment."""
        return ((f.param, self.grad[f.shard_offset:f.shard_offset + f.numel]) for f in self.layout.fragments)

    def drop_grad(self) -> None:
        """Free the gradient shard (torch's zero_grad(set_to_none=True)); the next backward makes a new one."""
        if self.grad is not None and self._grad_host is not None:
            self._grad_host.release()     # pages dropped: reads as zeros when it is next used
        self.grad = None

    zero_grad = drop_grad

    # -- checkpoints -----------------------------------------------------------------------------
    def visit(self, fn, create=None) -> None:
        """fn(fragment index, fp32 master view, optimizer state dict) for every fragment, sub-group by
        sub-group (swapped in from NVMe and back). `create(param index, lo, hi)` ({state name: dtype}) makes
        missing states first, so a checkpoint can be loaded before the first step."""
        for k, sg in enumerate(self.subgroups):
            master = self._swap_in(k, sg) if self.swap else None
            for i in sg.frags:
                t = self.frag_tensors[i]
                state = sg.optimizer.state[t]
                if create is not None and not state:
                    f = self.layout.fragments[i]
                    for name, dtype in create(f.param, f.param_offset, f.param_offset + f.numel).items():
                        state[name] = torch.zeros_like(t, dtype=dtype)
                fn(i, t, state)
            if self.swap:
                self._swap_out(k, sg, master)

    # -- accounting ------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict:
        """Resident bytes of master weights and optimizer states, where they live, and bytes on disk."""
        states = sum(v.numel() * v.element_size() for sg in self.subgroups for s in sg.optimizer.state.values()
                     for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        master = 0 if self.aliased or self.master is None else self.master.numel() * 4
        out = {"master_weights": master, "optimizer_states": states, "disk": self.swap.size() if self.swap else 0}
        out["host"] = master + states if self.offload != "none" else 0
        return out
