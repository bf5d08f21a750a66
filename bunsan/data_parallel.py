"""Data parallelism with replicated model states (ZeRO stage 0), and the interface every stage implements.

The engine drives a strategy through one optimizer step:

    begin_backward(sync) -> loss.backward() -> end_backward(sync)    (per micro-batch)
    norm = unscale(inv)      gradients x inv (loss scale, averaging); the global L2 norm
    clip(coef); step(); zero_grad()

Stage 0 keeps full parameters and gradients on every rank in flat buffers
(grad_sync.py) and all-reduces the gradient buckets from backward hooks.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .comm import Comm, Group
from .grad_sync import BucketHooks, FlatParams
from .optim import rebuild_over
from .zero.layout import ShardLayout


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


class Replicated(Strategy):
    """ZeRO stage 0: every rank holds everything; bucketed all-reduce overlapped with backward."""

    def __init__(self, params, comm, group, zero_cfg, build_optimizer, user_optimizer=None):
        super().__init__(params, comm, group, zero_cfg)
        groups = ShardLayout.greedy_buckets([p.numel() for p in self.params], int(zero_cfg.reduce_bucket_size))
        self.layout = ShardLayout(self.params, groups, n=1, rank=0, align=1)
        self.flat = FlatParams(self.params, self.layout)
        comm.broadcast(self.flat.data, 0, group)   # every replica starts from dp rank 0's weights
        self._handles = []
        self.hooks = BucketHooks(self.params, [b.params for b in self.layout.buckets], self._launch,
                                 overlap=zero_cfg.overlap_comm) if group.size > 1 else None
        # fp32 master weights for a 16-bit model: one flat buffer, one view per parameter.
        self.master, self.masters = None, []
        if self.mixed:
            self.master = self.flat.data.float()
            self.masters = [self.flat.view(self.master, i) for i in range(len(self.params))]
            to_master = dict(zip(self.params, self.masters))
        trainable = self.params[::-1]
        if user_optimizer is None:
            self.optimizer = build_optimizer([to_master[p] for p in trainable] if self.mixed else trainable)
        elif self.mixed:
            self.optimizer = rebuild_over(user_optimizer, to_master)
        else:
            self.optimizer = user_optimizer
        self._g32 = None
        # 16-bit models step in pieces (a bucket's parameters at a time), each given fp32 gradients made just
        # before: no fp32 copy of all gradients exists. torch's optimizers (and bitsandbytes') skip a parameter
        # without a gradient and keep no state across parameters, so stepping in pieces is the same step; for
        # any other optimizer the fp32 gradients are made all at once.
        module = type(self.optimizer).__module__
        self._pieces = [b.params for b in self.layout.buckets] if module.startswith(("torch.optim", "bitsandbytes")) \
            else [tuple(range(len(self.params)))]
        self._inv = self._coef = 1.0

    def _launch(self, k: int) -> None:
        b = self.layout.buckets[k]
        self._handles.append(self.comm.all_reduce(self.flat.grad[b.start:b.start + b.size], self.group,
                                                  async_op=True))

    def begin_backward(self, sync: bool) -> None:
        if not self.flat.grads_attached():  # someone called zero_grad(set_to_none=True) on the model
            self.flat.attach()
        if sync and self.hooks:
            self.hooks.begin()

    def end_backward(self, sync: bool) -> None:
        if sync and self.hooks:
            self.hooks.finish()
            for h in self._handles:
                h.wait()
            self._handles = []

    def unscale(self, inv: float) -> torch.Tensor:
        pieces = ((i, self.flat.view(self.flat.grad, i)) for i in range(len(self.params)))
        if self.mixed:      # the fp32 gradients are made piece by piece in step(), x inv then
            self._inv = inv
            sq = self.squared_norm(self.flat.grad, pieces)   # in fp32 from the 16-bit gradients
            return self.global_norm(sq * (inv * inv) if inv != 1.0 else sq, sharded=False)
        if inv != 1.0:
            self.flat.grad.mul_(inv)
        self._g32 = self.flat.grad
        return self.global_norm(self.squared_norm(self._g32, pieces), sharded=False)   # equal on every dp rank

    def clip(self, coef: float) -> None:
        if self.mixed:
            self._coef = coef
        else:
            self._g32.mul_(coef)

    def step(self) -> None:
        if not self.mixed:          # the parameters' .grad are views of the (unscaled, clipped) flat buffer
            self.optimizer.step()
            return
        for members in self._pieces:
            for i in members:
                g = self.flat.view(self.flat.grad, i).float()
                if self._inv != 1.0:      # the same two products, in the same order, as one fp32 copy would get
                    g.mul_(self._inv)
                if self._coef != 1.0:
                    g.mul_(self._coef)
                self.masters[i].grad = g
            self.optimizer.step()
            for i in members:
                self.masters[i].grad = None
        self.flat.data.copy_(self.master)

    def zero_grad(self) -> None:
        self._g32 = None
        self._inv = self._coef = 1.0
        self.flat.grad.zero_()   # not flat.zero_grad(): stage 0 keeps DDP's speed (no page faults per step)

    def visit_state(self, fn, create=None) -> None:
        for i, p in enumerate(self.params):
            t = self.masters[i] if self.mixed else p
            state = self.optimizer.state[t]
            if create is not None and not state:
                for name, dtype in create(i, 0, t.numel()).items():
                    state[name] = torch.zeros_like(t, dtype=dtype)
            fn(i, 0, t.detach().view(-1), state)

    def sync_params_from_master(self) -> None:
        if self.mixed:
            self.flat.data.copy_(self.master)

    def bytes_by_kind(self) -> dict:
        opt = [v for s in self.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": self.flat.data.numel() * self.flat.data.element_size(),
                "grads": self.flat.grad.numel() * self.flat.grad.element_size(),
                "master_weights": self.master.numel() * 4 if self.master is not None else 0,
                "optimizer_states": sum(v.numel() * v.element_size() for v in opt)}
