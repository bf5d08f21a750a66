"""ZeRO stage 0: data parallelism with replicated model states.

Every rank keeps full parameters and gradients in flat buffers (buckets.py) and
all-reduces the gradient buckets from backward hooks, overlapped with backward.

An optimizer that averages its own compressed state (optim/onebit.py: 1-bit Adam, 0/1 Adam, 1-bit LAMB) says
before each step whether it wants the gradients all-reduced (`reduce_next_gradients`); when not, each rank
keeps its own, scaled as its local mean, and the norm the step clips against is the root mean square of the
ranks' norms: the same on every rank, so clipping and fp16's overflow skip agree everywhere.
"""

from __future__ import annotations

import torch

from bunsan.comm.onebit import OneBitAllReduce
from bunsan.optim.optimizers import rebuild_over
from bunsan.zero.buckets import BucketHooks, FlatParams
from bunsan.zero.layout import ShardLayout
from bunsan.zero.strategy import Strategy


class Replicated(Strategy):
    """ZeRO stage 0: every rank holds everything; bucketed all-reduce overlapped with backward."""

    def __init__(self, params, comm, group, zero_cfg, dims, module, build_optimizer, user_optimizer=None):
        super().__init__(params, comm, group, zero_cfg, dims, module)
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
        self._local = False        # this step's gradients were not all-reduced (the optimizer averages its own)
        if hasattr(self.optimizer, "reduce_next_gradients") and hasattr(self.optimizer, "bind"):
            device = self.master.device if self.mixed else self.flat.data.device
            self.optimizer.bind(lambda numel: OneBitAllReduce(comm, group, numel, device), group.size)

    def _launch(self, k: int) -> None:
        b = self.layout.buckets[k]
        self._handles.append(self.comm.all_reduce(self.flat.grad[b.start:b.start + b.size], self.group,
                                                  async_op=True))

    def begin_backward(self, sync: bool) -> None:
        if not self.flat.grads_attached():  # someone called zero_grad(set_to_none=True) on the model
            self.flat.attach()
        if sync:
            self._local = self.hooks is not None and not getattr(self.optimizer, "reduce_next_gradients", True)
        if sync and self.hooks and not self._local:
            self.hooks.begin()

    def end_backward(self, sync: bool) -> None:
        if sync and self.hooks and not self._local:
            self.hooks.finish()
            for h in self._handles:
                h.wait()
            self._handles = []

    def unscale(self, inv: float) -> torch.Tensor:
        pieces = ((i, self.flat.view(self.flat.grad, i)) for i in range(len(self.params)))
        ranks = self.group.size if self._local else 1
        inv *= ranks        # local gradients: each rank's own mean (the reduced sum would have been x 1/dp)
        if self.mixed:      # the fp32 gradients are made piece by piece in step(), x inv then
            self._inv = inv
            sq = self.squared_norm(self.flat.grad, pieces)   # in fp32 from the 16-bit gradients
            return self.global_norm(sq * (inv * inv / ranks), sharded=self._local)
        if inv != 1.0:
            self.flat.grad.mul_(inv)
        self._g32 = self.flat.grad
        # reduced: equal on every dp rank; local: the root mean square of the ranks' norms
        return self.global_norm(self.squared_norm(self._g32, pieces) / ranks, sharded=self._local)

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
        self.flat.grad.zero_()   # not flat.zero_grad(): the pages stay resident, so no page faults per step

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
