"""1-bit Adam, 0/1 Adam and 1-bit LAMB: optimizers that own their communication (DeepSpeed's OneBitAdam,
ZeroOneAdam and OneBitLamb; DeepSpeed 0.19 dropped them, DeepSpeedExamples' BERT configs still name them).

After a warm-up in full precision they stop the engine's gradient all-reduce (`reduce_next_gradients` false:
ZeRO stage 0 reads it before each step's backward) and average, instead, a 1-bit compressed tensor with error
feedback (comm/onebit.py): 1-bit Adam its momentum (Tang et al. 2021), 0/1 Adam its gradient while the variance
still updates and then the updates of several local steps (Lu et al. 2022), 1-bit LAMB its momentum with frozen
trust ratios rescaled by a fresh variance (Li et al. 2021). With local gradients the step's norm (clipping, fp16
overflow) is the root mean square of the ranks' norms, the same on every rank.

Each follows DeepSpeed's update (none of them corrects the moments' bias; `bias_correction` is accepted and, as
in DeepSpeed, read nowhere), except DeepSpeed's first step, which only allocated its buffers and moved no
weight: here every step trains. The strategy binds `average_factory(numel) -> average(x)` and the group size;
unbound (one rank) nothing is compressed.
"""

from __future__ import annotations

import torch

from bunsan.optim.deepspeed_optimizers import moments

__all__ = ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"]


def _check(lr, eps, weight_decay, amsgrad, max_grad_norm, name):
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"{name}: lr {lr}, eps {eps} and weight_decay {weight_decay} must be >= 0")
    if amsgrad:
        raise ValueError(f"{name} has no AMSGrad variant (nor has DeepSpeed's); drop amsgrad")
    if max_grad_norm:
        raise ValueError(f"{name}(max_grad_norm={max_grad_norm}): clip with the config's gradient_clipping")


class _Compressed(torch.optim.Optimizer):
    reduce_next_gradients = True      # the engine all-reduces the next step's gradients

    def bind(self, average_factory, ranks: int) -> None:
        self._factory, self.ranks, self._averages = average_factory, ranks, {}

    ranks = 1

    def _average(self, key, x: torch.Tensor) -> torch.Tensor:
        """x replaced by its 1-bit compressed average over the ranks (one error state per key)."""
        if self.ranks == 1:
            return x
        if key not in self._averages:
            self._averages[key] = self._factory(x.numel())
        return self._averages[key](x)

    def _moments(self, p):
        return moments(self.state[p], p)


class OneBitAdam(_Compressed):
    """Adam for freeze_step steps on all-reduced gradients; then the variance is frozen and each rank's momentum
    of its local gradient is averaged 1-bit compressed: m = avg(b1 m + (1 - b1) g), p -= lr (m / (sqrt(v) + eps)
    + weight_decay p)."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl"):
        _check(lr, eps, weight_decay, amsgrad, max_grad_norm, "OneBitAdam")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.freeze_step, self.frozen = int(freeze_step), False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._moments(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                if self.frozen:
                    self._average(p, m)
                else:
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (m / (v.sqrt() + group["eps"])).add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        if not self.frozen and self._steps() >= self.freeze_step:
            self.frozen, self.reduce_next_gradients = True, False
        return loss

    def _steps(self) -> int:
        return max((int(s["step"]) for s in self.state.values() if "step" in s), default=0)


class ZeroOneAdam(_Compressed):
    """0/1 Adam: the variance updates on all-reduced gradients at steps spaced further and further apart
    (var_interval doubles every var_update_scaler updates), the steps between average the gradient 1-bit
    compressed; after var_freeze_step the variance is frozen and ranks take local steps, syncing their summed
    updates 1-bit compressed every local_step_interval steps (doubling every local_step_scaler steps, up to
    local_step_clipper)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl"):
        _check(lr, eps, weight_decay, amsgrad, max_grad_norm, "ZeroOneAdam")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.var_freeze_step, self.var_update_scaler = int(var_freeze_step), int(var_update_scaler)
        self.local_step_scaler, self.local_step_clipper = int(local_step_scaler), int(local_step_clipper)
        self.frozen, self._restarted = False, False
        self.step_count, self.var_interval, self.var_counter = 0, 1, 0
        self.local_interval, self.local_counter = 1, 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        self.step_count += 1
        t = self.step_count
        sync = self.frozen and t % self.local_interval == 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._moments(p)
                state["step"].fill_(t)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if self.frozen:
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                    state["lrs"] = state.get("lrs", 0.0) + group["lr"]   # the lrs since the last sync
                elif t % self.var_interval == 0:          # this step's gradients were all-reduced
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    m.mul_(b1).add_(p.grad, alpha=1 - b1)
                else:
                    m.mul_(b1).add_(self._average(p, p.grad.clone()), alpha=1 - b1)
                denom = v.sqrt() + group["eps"]
                update = (m / denom).add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                if self.frozen:
                    acc = state.setdefault("momentum_accumulator", torch.zeros_like(p))
                    acc.add_(update, alpha=-group["lr"])
                    if sync:   # undo the local steps, apply their averaged sum, and restart the momentum from it
                        p.sub_(acc)
                        acc.mul_(denom)
                        self._average(p, acc)
                        m.copy_(acc).div_(-state["lrs"])
                        p.add_(acc / denom)
                        acc.zero_()
                        state["lrs"] = 0.0
        self._schedule(t)
        return loss

    def _schedule(self, t: int) -> None:
        if not self.frozen:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            self.reduce_next_gradients = (t + 1) % self.var_interval == 0
        else:
            self.local_counter += 1
            if self.local_counter == self.local_step_scaler:
                self.local_counter = 0
                self.local_interval = min(self.local_step_clipper, self.local_interval * 2)
        if t > self.var_freeze_step and not self.frozen:
            self.frozen, self.reduce_next_gradients = True, False
            for average in getattr(self, "_averages", {}).values():   # the errors of gradients, not of updates
                average.worker_error.zero_()
                average.server_error.zero_()


class OneBitLamb(_Compressed):
    """LAMB for freeze_step steps on all-reduced gradients (each tensor's trust ratio tracked as an average,
    coeff_beta); then variance and ratios are frozen, the momenta (scaled to one common size) are averaged 1-bit
    compressed, and each ratio is rescaled by how far a fresh variance, rebuilt from the averaged momentum, has
    moved: factor = max(sqrt(v) / sqrt(v_fresh)), clamped to [factor_min, factor_max] and to within
    factor_threshold of the last step's."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1):
        _check(lr, eps, weight_decay, amsgrad, max_grad_norm, "OneBitLamb")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff))
        self.freeze_step, self.frozen = int(freeze_step), False
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold

    def _trained(self):
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        if self.frozen:
            self._compressed_step()
        else:
            self._warm_step()
        return loss

    def _warm_step(self) -> None:
        for group, p in self._trained():
            b1, b2 = group["betas"]
            state = self._moments(p)
            state.setdefault("lamb_coeff_freeze", 0.0)
            state.setdefault("last_factor", 1.0)
            state["step"] += 1
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            update = (m / (v.sqrt() + group["eps"])).add_(p, alpha=group["weight_decay"])
            w_norm, u_norm = p.norm().item(), update.norm().item()
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
            p.add_(update, alpha=-group["lr"] * coeff)
            if state["step"] == self.freeze_step:
                state["exp_avg_sq_fresh"] = v.clone()
        if self._trained() and self.state[self._trained()[0][1]]["step"] >= self.freeze_step:
            self.frozen, self.reduce_next_gradients = True, False
            scales = {p: (self.state[p]["exp_avg"].norm() / self.state[p]["exp_avg"].numel() ** 0.5).item()
                      for _, p in self._trained()}
            common = sum(scales.values()) / len(scales)
            for p, s in scales.items():   # momenta scaled to one size before they share one compression
                self.state[p]["scaling_coeff"] = common / s if s else 1.0

    def _compressed_step(self) -> None:
        trained = self._trained()
        last = {p: self.state[p]["exp_avg"].clone() for _, p in trained}
        for group, p in trained:
            b1 = group["betas"][0]
            state = self.state[p]
            state["step"] += 1
            state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1).mul_(state["scaling_coeff"])
        flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for _, p in trained])
        self._average("momenta", flat)
        offset = 0
        for group, p in trained:
            b1, b2 = group["betas"]
            state = self.state[p]
            m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
            m.copy_(flat[offset:offset + m.numel()].view_as(m)).div_(state["scaling_coeff"])
            offset += m.numel()
            grad = (m - last[p] * b1) / (1 - b1)          # the averaged gradient the momentum implies
            fresh.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = v.sqrt() + group["eps"]
            prelim = m / denom
            update = prelim + group["weight_decay"] * p if group["weight_decay"] else prelim
            factor = (denom / (fresh.sqrt() + group["eps"])).max().item()
            if group["weight_decay"]:
                ratio = min(1.0, (prelim.norm() / update.norm()).item())
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            bound = state["last_factor"]
            factor = min(max(factor, bound * (1 - self.factor_threshold)), bound * (1 + self.factor_threshold))
            state["last_factor"] = factor
            p.add_(update, alpha=-group["lr"] * state["lamb_coeff_freeze"] * factor)
