"""Preference objectives as the engine's objective (train.objective dpo, simpo or orpo): DPO (Rafailov et al.
2023) against a reference's log-probs, and two reference-free relatives, SimPO (Meng et al. 2024) and ORPO
(Hong et al. 2024).

A preference batch is a language-model dict whose rows come in pairs, chosen then rejected ([c0, r0, c1, r1,
...]: a micro-batch cut keeps pairs whole when its row count is even), for DPO with `ref_logps` [rows], each
row's response log-probability under the reference model. A row's log-probability is the sum over its trained
targets (labels != -100) of log p(target), from the engine's own token loss (vocabulary-parallel under
tensor parallelism); SimPO and ORPO read its mean over those targets. Per pair:

    dpo     m = (logp_c - ref_c) - (logp_r - ref_r);  -(1 - label_smoothing) log sigmoid(beta m)
                                                      - label_smoothing log sigmoid(-beta m)
    simpo   -log sigmoid(beta (mean_c - mean_r) - gamma)
    orpo    -mean_c - beta log sigmoid(log odds_c - log odds_r),  log odds = mean - log(1 - exp(mean))

and the step's loss is the mean over the pairs of the whole global batch, whatever their micro-batch or rank.
(ORPO's NLL term is so the chosen response's mean NLL per pair, averaged over pairs; TRL's averages over the
batch's chosen tokens, which weighs long responses more.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bunsan.engine.batch import Objective, make_objective, split

__all__ = ["REF_LOGPS", "PreferenceObjective", "dpo_losses", "objective_for", "orpo_losses", "row_logps",
           "sequence_logps", "simpo_losses"]

REF_LOGPS = "ref_logps"


def row_logps(logits: torch.Tensor, targets: torch.Tensor, lm_loss_sum, over=None) -> torch.Tensor:
    """Each row's summed log-probability of its targets (-100 ignored), through the engine's token loss.
    `over` (comm, group): context parallelism, each rank holding a share of every row's tokens; the shares'
    sums are added up over the group, differentiably."""
    logps = -torch.stack([lm_loss_sum(logits[i:i + 1], targets[i:i + 1]) for i in range(logits.shape[0])])
    return logps if over is None else SumOverGroup.apply(logps, *over)


class SumOverGroup(torch.autograd.Function):
    """x summed over `group` on every rank. Backward sums the gradients too: every rank's loss reads the
    whole sum, so each rank's share feeds every rank's loss."""

    @staticmethod
    def forward(fctx, x, comm, group):
        fctx.comm, fctx.group = comm, group
        out = x.clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(fctx, grad):
        grad = grad.clone()
        fctx.comm.all_reduce(grad, fctx.group)
        return grad, None, None


@dataclass
class PreferenceObjective(Objective):
    """A loss over (chosen, rejected) row pairs: `kind` dpo, simpo or orpo (pair_losses)."""
    kind: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0        # dpo
    gamma: float = 0.0                  # simpo
    over: tuple | None = None           # (comm, context-parallel group): rows' sums span its ranks

    def forward(self, module, mb):
        return super().forward(module, {k: v for k, v in mb.items() if k != REF_LOGPS})

    def _lm_sum(self, output, mb) -> torch.Tensor:
        """The loss summed over the micro-batch's pairs."""
        logits = output.logits if hasattr(output, "logits") else output
        if logits.shape[0] % 2:
            raise ValueError(f"a preference micro-batch of {logits.shape[0]} rows: rows come in (chosen, rejected) "
                             "pairs, so every micro-batch holds an even number (train_micro_batch_size_per_gpu)")
        targets = self.targets(mb)
        logps = row_logps(logits, targets, self.lm_loss_sum, self.over)
        if self.kind == "dpo":
            return dpo_losses(logps, mb[REF_LOGPS].to(logps), self.beta, self.label_smoothing).sum()
        counts = (targets != -100).sum(-1).to(logps.dtype)
        if self.over is not None:
            counts = SumOverGroup.apply(counts, *self.over)
        # checked where the counts live, without the host waiting for the device (raised at the next sync on a GPU)
        torch._assert_async((counts > 0).all(), f"a preference row with no scored token (labels all -100): "
                            f"{self.kind}'s mean token log-prob needs a response in every row")
        mean = logps / counts
        if self.kind == "simpo":
            return simpo_losses(mean, self.beta, self.gamma).sum()
        return orpo_losses(mean, self.beta).sum()

    def tokens(self, micro: list) -> torch.Tensor:
        """What the loss is a mean over: the pairs (a 1-element fp64 device tensor). Under context parallelism
        every rank of the group counts its dp rank's pairs and reports their whole loss, so both the count and
        the sum are the group's size times the pairs': the mean (and, through SumOverGroup, the gradient)
        holds."""
        pairs = sum(mb["input_ids"].shape[0] // 2 for mb in micro)
        return torch.full((1,), float(pairs), dtype=torch.float64, device=micro[0]["input_ids"].device)


def dpo_losses(logps: torch.Tensor, ref: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """Per pair, m = (logp_c - ref_c) - (logp_r - ref_r): -(1 - eps) log sigmoid(beta m) - eps log sigmoid(-beta m)
    (Rafailov et al. 2023; eps the conservative DPO's label smoothing)."""
    margin = (logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2])
    eps = label_smoothing
    return -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)


def simpo_losses(mean: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """SimPO (Meng et al. 2024), from each row's mean token log-prob: -log sigmoid(beta (mean_c - mean_r) - gamma)."""
    return -F.logsigmoid(beta * (mean[0::2] - mean[1::2]) - gamma)


def orpo_losses(mean: torch.Tensor, beta: float) -> torch.Tensor:
    """ORPO (Hong et al. 2024), from each row's mean token log-prob (log P): the chosen response's mean NLL minus
    beta log sigmoid(log odds_c - log odds_r), log odds = log P - log(1 - P)."""
    log_odds = mean - torch.log(-torch.expm1(mean))
    return -mean[0::2] - beta * F.logsigmoid(log_odds[0::2] - log_odds[1::2])


def objective_for(engine, batch) -> Objective:
    """The engine's objective for `batch`: with a preference train.objective its pair loss, else make_objective's."""
    cfg = engine.cfg
    kind = cfg.train.objective
    if kind == "lm":
        return make_objective(batch, engine.loss_fn, engine._lm_loss_sum, engine.module)
    if not isinstance(batch, dict) or (kind == "dpo" and REF_LOGPS not in batch):
        raise ValueError(f"train.objective {kind} trains on preference batches: dicts of input_ids and labels"
                         + (f" and {REF_LOGPS!r} (each row's reference log-probability)" if kind == "dpo" else "")
                         + ", rows in (chosen, rejected) pairs")
    if engine.loss_fn is not None:
        raise ValueError(f"train.objective {kind} computes its own loss: drop loss_fn from bunsan.initialize")
    base = make_objective({k: v for k, v in batch.items() if k != REF_LOGPS}, None, engine._lm_loss_sum,
                          engine.module)
    settings = {"dpo": dict(beta=cfg.dpo.beta, label_smoothing=cfg.dpo.label_smoothing),
                "simpo": dict(beta=cfg.simpo.beta, gamma=cfg.simpo.gamma), "orpo": dict(beta=cfg.orpo.beta)}[kind]
    return PreferenceObjective(True, base.lm_loss_sum, None, keywords=base.keywords, shift=base.shift,
                               use_cache=base.use_cache, kind=kind, over=_context_parallel(engine), **settings)


def _context_parallel(engine) -> tuple | None:
    return None if engine.cp is None else (engine.comm, engine.mesh.cp_group)


@torch.no_grad()
def sequence_logps(engine, batch) -> torch.Tensor:
    """Each row's summed log-probability of its trained targets under the engine's model as it is now (the
    reference of a DPO run, before its first step), on every rank: a forward of the whole per-rank batch, through
    the pipeline's stages when there are some. Every rank of the engine calls it (ZeRO-3 gathers, tensor-parallel
    heads and context-parallel sums are collectives)."""
    plain = {k: v for k, v in batch.items() if k != REF_LOGPS}
    objective = make_objective(plain, None, engine._lm_loss_sum, engine.module)
    mb = engine._cut(split(plain, 1, engine.device))[0]
    over = _context_parallel(engine)
    was_training = engine.module.training
    engine.module.eval()
    try:
        with engine._logits_for(objective):
            if engine.pipe is not None:
                return _pipeline_logps(engine, objective, mb, over)
            output = objective.forward(engine.module, mb)
            logits = output.logits if hasattr(output, "logits") else output
            return row_logps(logits, objective.targets(mb), engine._lm_loss_sum, over).double()
    finally:
        engine.module.train(was_training)


def _pipeline_logps(engine, objective, mb, over) -> torch.Tensor:
    """sequence_logps through the stages (forward only): the last stage scores the rows, then hands them on."""
    pipe = engine.pipe
    rows = torch.zeros(mb["input_ids"].shape[0], dtype=torch.float64, device=engine.device)

    def score(out, batch):
        logits = out.logits if hasattr(out, "logits") else out
        rows.copy_(row_logps(logits, objective.targets(batch), engine._lm_loss_sum, over))
        return None, rows.new_zeros(1)

    with engine.strategy.pipeline_evaluation():
        pipe.runner.evaluate([mb], objective.first_input, score, objective.seq_len)
    pipe.comm.broadcast(rows, pipe.p - 1, pipe.group)
    return rows
