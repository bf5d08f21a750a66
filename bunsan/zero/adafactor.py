"""torch.optim.Adafactor's update on ZeRO fragments, the same numbers as on whole tensors.

Adafactor keeps, for a matrix W [R, C], a second moment per row and per column (the means of g^2 over a
row, over a column) and scales the step by W's RMS and by the update's RMS. A ZeRO shard holds a flat run
of W's elements that cuts rows anywhere, so none of those is local. What is: each fragment's share of the
sums. Every rank adds its fragments' g^2 into row and column sums (and its W^2 into W's sum of squares),
one all-reduce over the data-parallel group completes them, and every rank holding part of W keeps the
factored moments of all of W (R + C numbers: Adafactor's point is that they are small). A second
all-reduce completes the update's sum of squares. Vectors (norms) keep a moment per element, as torch does.

Collectives: two all-reduces per step of sizes (parameters + rows + columns) and (parameters), the same
on every rank whatever it holds. Memory: the update of the shard is held between them (4 bytes per element).
"""

from __future__ import annotations

import math

import torch


class ShardedAdafactor(torch.optim.Optimizer):
    def __init__(self, params, where: dict, shapes: list[tuple[int, ...]], all_reduce, lr: float = 1e-2,
                 beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0, weight_decay: float = 0.0,
                 maximize: bool = False, foreach=None):
        """where: id(fragment tensor) -> (parameter index, first element in the flattened parameter);
        shapes: every parameter of the layout (all ranks' buffers line up by them); all_reduce(t): in-place
        SUM over the data-parallel group."""
        bad = [s for s in shapes if len(s) > 2]
        if bad:
            raise ValueError(f"Adafactor under ZeRO factors matrices and vectors; parameters of shape {bad[0]} "
                             "have more dimensions: use zero_optimization.stage 0 for this model")
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                      maximize=maximize))
        self.where, self.shapes, self.all_reduce = where, shapes, all_reduce
        self.offsets, off = [], len(shapes)          # stats buffer: [sum W^2 per parameter | rows | cols ...]
        for s in shapes:
            self.offsets.append(off)
            off += sum(s) if len(s) == 2 else 0
        self.stats_numel = off

    @torch.no_grad()
    def step(self, closure=None):
        """Three passes, with one all-reduce between each two: the row/column gradient statistics of every
        fragment, the updates from the reduced moments, and the step sizes from the reduced update norms."""
        device = self.param_groups[0]["params"][0].device
        stats, work = self._statistics(device)
        self.all_reduce(stats)
        updates, upd_sq = self._updates(work, stats, device)
        self.all_reduce(upd_sq)
        self._apply(work, updates, stats, upd_sq)

    def _statistics(self, device: torch.device):
        """Per parameter its squared-value sum and, for matrices, the squared gradient by row and column (this
        rank's fragment of them); and the work list of the fragments to update."""
        stats = torch.zeros(self.stats_numel, dtype=torch.float32, device=device)
        work = []
        for group in self.param_groups:
            for t in group["params"]:
                if t.grad is None or not t.numel():
                    continue
                i, lo = self.where[id(t)]
                shape, g = self.shapes[i], (-t.grad if group["maximize"] else t.grad)
                state = self.state[t]
                if not state:
                    state["step"] = torch.tensor(0.0)   # host: a step counter, as torch's optimizers keep it
                    if len(shape) == 2:
                        state["row_var"] = torch.zeros(shape[0], 1, dtype=torch.float32, device=device)
                        state["col_var"] = torch.zeros(1, shape[1], dtype=torch.float32, device=device)
                    else:
                        state["variance"] = torch.zeros_like(t)
                stats[i] += t.square().sum()
                index = None
                if len(shape) == 2:
                    r, c = shape
                    flat = torch.arange(lo, lo + t.numel(), device=device)
                    index = (flat // c, flat % c)
                    g2 = g.square()
                    o = self.offsets[i]
                    stats[o:o + r].index_add_(0, index[0], g2)
                    stats[o + r:o + r + c].index_add_(0, index[1], g2)
                work.append((group, t, g, i, index, state))
        return stats, work

    def _updates(self, work: list, stats: torch.Tensor, device: torch.device):
        """Each fragment's update from the factored (or full) second moment; and their squared norms."""
        updates, upd_sq = [], torch.zeros(len(self.shapes), dtype=torch.float32, device=device)
        for group, t, g, i, index, state in work:
            eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(t.dtype).eps
            state["step"] += 1
            one_minus_beta2 = state["step"].item() ** group["beta2_decay"]   # host: the host-side counter
            if index is not None:
                r, c = self.shapes[i]
                o = self.offsets[i]
                state["row_var"].lerp_(stats[o:o + r].div(c).view(r, 1), one_minus_beta2)
                state["col_var"].lerp_(stats[o + r:o + r + c].div(r).view(1, c), one_minus_beta2)
                row, col = state["row_var"].view(-1), state["col_var"].view(-1)
                var = row[index[0]] * col[index[1]] / row.mean().clamp(min=eps1)
            else:
                state["variance"].lerp_(g.square(), one_minus_beta2)
                var = state["variance"].clone()
            update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
            upd_sq[i] += update.square().sum()
            updates.append(update)
        return updates, upd_sq

    def _apply(self, work: list, updates: list, stats: torch.Tensor, upd_sq: torch.Tensor) -> None:
        # The step sizes stay on the device (in fp64, as the host arithmetic they replace): read per
        # parameter on the host they would stall a GPU once per weight.
        rms, upd_rms = stats[:len(self.shapes)].double().sqrt(), upd_sq.double().sqrt()
        for (group, t, g, i, _, state), update in zip(work, updates):
            lr, numel = float(group["lr"]), math.prod(self.shapes[i])
            rho = min(lr, 1 / state["step"].item() ** 0.5)   # host: the host-side counter
            alpha = (rms[i] / numel ** 0.5).clamp(min=group["eps"][1]) * rho
            if group["weight_decay"]:
                t.mul_(1 - lr * group["weight_decay"])
            denom = (upd_rms[i] / (numel ** 0.5 * group["d"])).clamp(min=1.0)
            t.sub_(update.mul_((alpha / denom).to(t.dtype)))     # (update is not needed after)
