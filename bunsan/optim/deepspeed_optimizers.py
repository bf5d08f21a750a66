"""The two optimizers DeepSpeed configs name that torch has no class for: Adam without bias correction
(DeepSpeed's FusedAdam with `bias_correction: false`) and LAMB (DeepSpeed's FusedLamb).

Both are plain torch.optim.Optimizer subclasses over each tensor's own elements (Adam) or each tensor as a whole
(LAMB's trust ratio is a norm of the whole weight and of its whole update); optim/stepping.py says where each may
step (LAMB: not on a ZeRO shard or a tensor-parallel slice, where the norms would be a piece's).
"""

from __future__ import annotations

import torch

__all__ = ["UncorrectedAdam", "Lamb", "moments"]


def moments(state: dict, p: torch.Tensor) -> dict:
    """Adam's two moments and a step count in an optimizer's `state` for `p`, made at its first step."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    return state


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam whose moments are not divided by (1 - beta^t): p -= lr * (m / (sqrt(v) + eps)), with decoupled
    weight decay (AdamW's, DeepSpeed's adam_w_mode true) or L2 added to the gradient (adam_w_mode false)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = True):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"lr {lr}, eps {eps}, weight_decay {weight_decay} must be >= 0 and betas {betas} "
                             "in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if group["decoupled_weight_decay"] or not wd else p.grad.add(p, alpha=wd)
                state = moments(self.state[p], p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if group["decoupled_weight_decay"] and wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-lr)
        return loss


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) as DeepSpeed's FusedLamb computes it, per tensor:

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        u = m / (sqrt(v) + eps) + weight_decay * p          (eps_inside_sqrt: m / sqrt(v + eps))
        ratio = ||p|| / ||u||, clamped to [min_coeff, max_coeff] (1 when either norm is 0)
        p -= step_size * ratio * u,  step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)  (lr without bias_correction)
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01):
        if lr < 0 or eps < 0 or weight_decay < 0 or not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"lr {lr}, eps {eps}, weight_decay {weight_decay} must be >= 0 and 0 <= min_coeff "
                             f"{min_coeff} <= max_coeff {max_coeff}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = moments(self.state[p], p)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
                update = (m / denom).add_(p, alpha=group["weight_decay"])
                # the trust ratio stays on the device: no host read per tensor inside the step
                w_norm, u_norm = p.norm(), update.norm()
                ratio = torch.where((w_norm != 0) & (u_norm != 0),
                                    (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                                    torch.ones_like(w_norm))
                step_size = group["lr"] * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t) if group["bias_correction"] \
                    else group["lr"]
                p.sub_(update * (ratio * step_size))
        return loss
