"""The interface every data-parallel strategy (ZeRO stages 0-3) implements.

The engine drives a strategy through one optimizer step:

    begin_backward(sync) -> loss.backward() -> end_backward(sync)    (per micro-batch)
    norm = unscale(inv)      gradients x inv (loss scale, averaging); the global L2 norm
    clip(coef); step(); zero_grad()
"""

from __future__ import annotations

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm, Group


class Strategy:
    """Common parts: the trainable parameters in backward order, and the optimizer spec."""

    stage = 0

    def __init__(self, params: list[nn.Parameter], comm: Comm, group: Group, zero_cfg):
        self.params = list(reversed(params))      # backward order
        self.comm, self.group, self.zero = comm, group, zero_cfg
        self.dtype = params[0].dtype
        self.mixed = self.dtype != torch.float32

    def set_tensor_parallel(self, tp_group: Group | None) -> None:
        """Under tensor parallelism replicated weights (norms) are counted once, on TP rank 0, in the norm."""
        self.tp_group = tp_group
        self.norm_excluded: set[int] = set()
        if tp_group is not None and tp_group.size > 1 and tp_group.rank != 0:
            self.norm_excluded = {i for i, p in enumerate(self.params) if getattr(p, "_bunsan_tp_replicated", False)}

    def set_pipeline(self, pp_group: Group | None, duplicates: set) -> None:
        """Under pipeline parallelism the norm sums over stages; a weight tied across stages counts once."""
        self.pp_group = pp_group
        extra = {i for i, p in enumerate(self.params) if any(p is d for d in duplicates)}
        self.norm_excluded = set(getattr(self, "norm_excluded", set())) | extra

    def squared_norm(self, flat: torch.Tensor, pieces) -> torch.Tensor:
        """|flat|^2 as a 1-element fp64 tensor on flat's device, or the sum over the (param index, view) pieces
        not excluded from the norm. Norms in fp32, squared and summed in fp64: the square of an fp32 number is
        exact there, so one rank's whole norm comes back bit for bit as torch computes it. Never read on the
        host here: the engine reads the global norm once, at the optimizer boundary."""
        excluded = getattr(self, "norm_excluded", ())
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
        for other in (getattr(self, "tp_group", None), getattr(self, "pp_group", None)):
            if other is not None and other.size > 1:
                self.comm.all_reduce(total, other)
        return total.sqrt()

    def consolidated_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}

    # -- checkpoints (checkpoint/pieces.py) --------------------------------------------------------
    def visit_state(self, fn, create=None) -> None:
        """fn(param index, first element, fp32 master values (1-D view), optimizer state dict) for every
        piece of weights and optimizer state this rank steps; `create(param index, lo, hi)` ({state name:
        dtype}) makes missing states first."""
        raise NotImplementedError

    def sync_params_from_master(self) -> None:
        """After masters were loaded: the model's weights (every rank's copy) from them."""
        raise NotImplementedError

    def bytes_by_kind(self) -> dict:
        raise NotImplementedError


class Sharded(Strategy):
    """Stages 1-3: the fp32 gradient shard of the sharded optimizer (self.opt) is what gets unscaled and clipped."""

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
