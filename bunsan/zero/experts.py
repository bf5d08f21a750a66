"""Expert parallelism under any ZeRO stage: two data-parallel strategies side by side, one per kind of weight.

    dense    every weight but the experts': reduced (and ZeRO-sharded) over the gradient group, as without EP
    experts  this rank's slice of each MoE block's experts: reduced and sharded over the expert-data-parallel
             group, the ranks that hold the same slice (DeepSpeed's expert-DP groups, torchtitan's efsdp)

Both see the same loss: an expert's gradient on its rank already sums what every rank of the expert-parallel
group sent it (the dispatch's all-to-all carries the gradients back), so summing over the expert's replicas
sums over every rank, the same total the dense weights reach by summing over the gradient group; one
unscale factor serves both. The gradient norm is the dense norm with the experts' added over the
expert-parallel group (each rank there holds other experts), then summed over the pipeline stages once, here: a
stage of dense layers only (no experts, no split) sums its norm over the stages once too, so every stage takes
part in the same collectives. The optimizer the user built is split in two of
its class, with its hyperparameters per group; `optimizer` shows both as one for the learning-rate schedule.
"""
from __future__ import annotations

import contextlib

import torch

from bunsan.comm.collectives import Comm, Group
from bunsan.zero.strategy import Strategy


class JointOptimizer:
    """Two optimizers read as one: their param_groups (dense first) and state, for schedules and users; for
    checkpoints, which of the user's groups each param group is part of (`sources`: per part, its groups'
    indices among the user's, of `user_groups` in all), whatever the expert-parallel size."""

    def __init__(self, dense, experts, sources: tuple[list[int], list[int]], user_groups: int):
        from bunsan.optim.lrs import group_sources
        self.optimizers = (dense, experts)
        self.group_sources = [src[s] for opt, src in zip(self.optimizers, sources) for s in group_sources(opt)]
        self.groups = [None] * user_groups

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {**self.optimizers[0].state, **self.optimizers[1].state}

    @property
    def defaults(self) -> dict:
        return self.optimizers[0].defaults

    def state_dict(self):
        raise NotImplementedError("the optimizer of an expert-parallel engine is two optimizers (dense weights, "
                                  "experts); save with engine.save_checkpoint")


class ExpertSplit(Strategy):
    """The dense weights' strategy and the experts' (see the module docstring), driven as one."""

    def __init__(self, dense: Strategy, experts: Strategy, comm: Comm, ep_group: Group,
                 sources: tuple[list[int], list[int]] = ([0], [0]), user_groups: int = 1,
                 pp_group: Group | None = None):
        """`dense` and `experts` sum their norms over every group but the pipeline's, `pp_group`, summed here."""
        # no Strategy.__init__: the two parts hold the parameters, buffers and optimizers
        self.dense, self.experts, self.comm, self.ep_group = dense, experts, comm, ep_group
        self.parts, self.pp_group = (dense, experts), pp_group
        self.stage, self.dims, self.zero = dense.stage, dense.dims, dense.zero
        self.params = dense.params + experts.params
        self.dtype, self.mixed = dense.dtype, dense.mixed
        self.optimizer = JointOptimizer(dense.optimizer, experts.optimizer, sources, user_groups)
        self.frozen_shards = dense.frozen_shards      # (frozen weights: the dense strategy's, ZeRO-3 shards them)

    @property
    def current_unit(self) -> str | None:
        return self.dense.current_unit or self.experts.current_unit

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        return self.dense.param_shapes + self.experts.param_shapes

    @property
    def opt_class(self) -> type:
        return self.dense.opt_class

    @property
    def opt_defaults(self) -> dict:
        return self.dense.opt_defaults

    @contextlib.contextmanager
    def gathered(self):
        with self.dense.gathered(), self.experts.gathered():
            yield

    @contextlib.contextmanager
    def pipeline_evaluation(self):
        with self.dense.pipeline_evaluation(), self.experts.pipeline_evaluation():
            yield

    def consolidated_state_dict(self, module) -> dict[str, torch.Tensor]:
        with self.gathered():       # (ZeRO-3: both parts' units gathered; earlier stages hold their weights)
            return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def _both(self, method: str, *args) -> None:
        """The same call on the dense part, then the experts' (each reduces over its own group)."""
        for part in self.parts:
            getattr(part, method)(*args)

    def begin_backward(self, sync: bool) -> None:
        self._both("begin_backward", sync)

    def end_backward(self, sync: bool) -> None:
        self._both("end_backward", sync)

    def begin_schedule(self) -> None:
        self._both("begin_schedule")

    def after_backward_piece(self) -> None:
        self._both("after_backward_piece")

    def end_schedule(self) -> None:
        self._both("end_schedule")

    def unscale(self, inv: float) -> torch.Tensor:
        dense = self.dense.unscale(inv).double()
        experts_sq = self.experts.unscale(inv).double().square().reshape(1)
        self.comm.all_reduce(experts_sq, self.ep_group)     # the other experts, on the other ranks of the group
        total = dense.square().reshape(1) + experts_sq
        if self.pp_group is not None and self.pp_group.size > 1:
            self.comm.all_reduce(total, self.pp_group)
        return total.sqrt()

    def clip(self, coef: float) -> None:
        self._both("clip", coef)

    def step(self) -> None:
        self._both("step")

    def zero_grad(self) -> None:
        self._both("zero_grad")

    def bytes_by_kind(self) -> dict:
        dense, experts = self.dense.bytes_by_kind(), self.experts.bytes_by_kind()
        return {k: dense.get(k, 0) + experts.get(k, 0) for k in dense.keys() | experts.keys()}

    def visit_state(self, fn, create=None) -> None:
        """Both parts' pieces, the experts' indices after the dense ones (self.params' order)."""
        self.dense.visit_state(fn, create)
        n = len(self.dense.params)
        self.experts.visit_state(lambda i, lo, master, state: fn(i + n, lo, master, state),
                                 None if create is None else (lambda i, lo, hi: create(i + n, lo, hi)))

    def replicas(self, index: int) -> Group:
        """The group whose ranks hold the same copy of parameter `index` (self.params' order)."""
        return self.dense.group if index < len(self.dense.params) else self.experts.group

    def sync_params_from_master(self) -> None:
        for s in self.parts:
            s.sync_params_from_master()
