"""The interface every data-parallel strategy (ZeRO stages 0-3) implements, and what it is told about the
other parallel dimensions.

The engine drives a strategy through one optimizer step:

    begin_backward(sync) -> loss.backward() -> end_backward(sync)    (per micro-batch)
    norm = unscale(inv)      gradients x inv (loss scale, averaging); the global L2 norm
    clip(coef); step(); zero_grad()

Under pipeline parallelism a micro-batch's backward comes in pieces spread over the schedule, so the pipeline
calls begin_schedule(), after_backward_piece() after each piece, and end_schedule(), which reduces every
gradient once, after the schedule.

The memory report reads bytes_by_kind(), checkpoints visit_state() and sync_params_from_master(); nothing
else of a strategy is read from outside, so a new strategy implements exactly what `Strategy` declares.
"""

from __future__ import annotations

import abc
import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm, Group


@dataclass(frozen=True)
class OtherDims:
    """What tensor and pipeline parallelism tell a data-parallel strategy: the groups its gradient norm also
    sums over, and the parameters whose norm another rank of those groups adds (a weight replicated over
    TP ranks counts on TP rank 0 only; a weight tied across stages counts on its first stage only)."""

    tp_group: Group | None = None
    pp_group: Group | None = None
    counted_elsewhere: frozenset[str] = frozenset()    # parameter names (module.named_parameters)


class Strategy(abc.ABC):
    """Common parts: the trainable parameters in backward order, the gradient norm over every dimension."""

    stage = 0
    current_unit: str | None = None    # the ZeRO-3 unit being gathered, for the doctor's out-of-memory advice
    frozen_shards = None               # ZeRO-3 shards frozen weights too (zero/frozen.py); else they are whole
    layout = None                      # the ShardLayout of self.params (zero/layout.py)
    optimizer: torch.optim.Optimizer   # what steps: torch's, or the sharded one (zero/optimizer.py)

    def __init__(self, params: list[nn.Parameter], comm: Comm, group: Group, zero_cfg, dims: OtherDims,
                 module: nn.Module):
        self.params = list(reversed(params))      # backward order
        self.comm, self.group, self.zero = comm, group, zero_cfg
        self.dims = dims
        self.dtype = params[0].dtype
        self.mixed = self.dtype != torch.float32
        self._elsewhere = {id(p) for n, p in module.named_parameters(remove_duplicate=False)
                           if n in dims.counted_elsewhere}

    @functools.cached_property
    def norm_excluded(self) -> set[int]:
        """Indices into self.params (final once the strategy is built) left out of this rank's norm."""
        return {i for i, p in enumerate(self.params) if id(p) in self._elsewhere}

    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        """Each parameter's shape on this rank (ZeRO-3's are empty between gathers: it keeps them)."""
        return [tuple(p.shape) for p in self.params]

    @property
    def opt_class(self) -> type:
        return type(self.optimizer)

    @property
    def opt_defaults(self) -> dict:
        return self.optimizer.defaults

    def gathered(self):
        """Context in which every parameter holds its full value (only ZeRO-3 has anything to gather)."""
        return contextlib.nullcontext()

    # -- the step ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def begin_backward(self, sync: bool) -> None:
        """Before a micro-batch's backward; `sync`: its gradients are the step's last (reduce them)."""

    @abc.abstractmethod
    def end_backward(self, sync: bool) -> None:
        """After a micro-batch's backward; with `sync` every reduction is complete on return."""

    def begin_schedule(self) -> None:
        """Before a pipeline schedule: gradients accumulate locally through it."""
        self.begin_backward(sync=False)

    def after_backward_piece(self) -> None:
        """After one backward piece (a micro-batch through one chunk) of a pipeline schedule."""

    def end_schedule(self) -> None:
        """After the schedule: every gradient reduced once, in bucket order; complete on return."""
        self.begin_backward(sync=True)
        self.end_backward(sync=True)

    def pipeline_evaluation(self):
        """Context around a pipeline's forward-only pass (ZeRO-3 gathers the stage's root unit)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def unscale(self, inv: float) -> torch.Tensor:
        """Gradients x inv; returns the global L2 norm, a device tensor (the engine reads it)."""

    @abc.abstractmethod
    def clip(self, coef: float) -> None:
        """Gradients x coef (coef < 1)."""

    @abc.abstractmethod
    def step(self) -> None:
        """The optimizer step, and the model's weights from it."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        ...

    # -- memory and checkpoints -------------------------------------------------------------------
    @abc.abstractmethod
    def bytes_by_kind(self) -> dict:
        """Bytes held by kind (params, grads, master_weights, optimizer_states), and `host` / `disk`."""

    @abc.abstractmethod
    def visit_state(self, fn, create=None) -> None:
        """fn(param index, first element, fp32 master values (1-D view), optimizer state dict) for every
        piece of weights and optimizer state this rank steps; `create(param index, lo, hi)` ({state name:
        dtype}) makes missing states first."""

    @abc.abstractmethod
    def sync_params_from_master(self) -> None:
        """After masters were loaded: the model's weights (every rank's copy) from them."""

    def consolidated_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    def squared_norm(self, flat: torch.Tensor, pieces) -> torch.Tensor:
        """|flat|^2 as a 1-element fp64 tensor on flat's device, or the sum over the (param index, view) pieces
        not excluded from the norm. Norms in fp32, squared and summed in fp64: the square of an fp32 number is
        exact there, so one rank's whole norm comes back bit for bit as torch computes it. Never read on the
        host here: the engine reads the global norm once, at the optimizer boundary."""
        excluded = self.norm_excluded
        if not excluded:
            return (torch.linalg.vector_norm(flat, dtype=torch.float32).double() ** 2).reshape(1)
        views = [v for i, v in pieces if i not in excluded and v.numel()]
        if not views:
            return torch.zeros(1, dtype=torch.float64, device=flat.device)
        norms = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32))
        return norms.double().square().sum().reshape(1)

    def global_norm(self, local_sq: torch.Tensor, sharded: bool) -> torch.Tensor:
        """sqrt of the sum of squared contributions: over data-parallel shards (ZeRO) and tensor-parallel
        slices and pipeline stages; a device tensor (the engine reads it). An offloaded optimizer's gradient
        shard is on the host: its 8-byte square goes to the device for the reductions."""
        total = local_sq.to(self.comm.device)
        if sharded:
            self.comm.all_reduce(total, self.group)
        for other in (self.dims.tp_group, self.dims.pp_group):
            if other is not None and other.size > 1:
                self.comm.all_reduce(total, other)
        return total.sqrt()


class Sharded(Strategy):
    """Stages 1-3: the fp32 gradient shard of the sharded optimizer (self.opt) is what gets unscaled and clipped."""

    @property
    def opt_class(self) -> type:
        return self.opt.opt_class       # the class each shard's optimizer is made of

    @property
    def opt_defaults(self) -> dict:
        return self.opt.defaults

    def unscale(self, inv: float) -> torch.Tensor:
        self.opt.ensure_grad()
        if inv != 1.0:
            self.opt.grad.mul_(inv)
        return self.global_norm(self.squared_norm(self.opt.grad, self.opt.grad_pieces()), sharded=True)

    def clip(self, coef: float) -> None:
        self.opt.grad.mul_(coef)

    def visit_state(self, fn, create=None) -> None:
        frags = self.layout.fragments
        self.opt.visit(lambda j, master, state: fn(frags[j].param, frags[j].param_offset, master, state), create)
