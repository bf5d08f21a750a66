"""Direct Preference Optimization (train.objective dpo; Rafailov et al. 2023) as the engine's objective.

A preference batch is a language-model dict whose rows come in pairs, chosen then rejected ([c0, r0, c1, r1,
...]: a micro-batch cut keeps pairs whole when its row count is even), with `ref_logps` [rows], each row's
response log-probability under the reference model. A row's log-probability is the sum over its trained
targets (labels != -100) of log p(target), from the engine's own token loss (vocabulary-parallel under
tensor parallelism). Per pair, with m = (logp_c - ref_c) - (logp_r - ref_r):

    loss = -(1 - label_smoothing) log sigmoid(beta m) - label_smoothing log sigmoid(-beta m)

and the step's loss is the mean over the pairs of the whole global batch, whatever their micro-batch or rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bunsan.engine.batch import Objective, make_objective, split

__all__ = ["REF_LOGPS", "PreferenceObjective", "objective_for", "row_logps", "sequence_logps"]

REF_LOGPS = "ref_logps"


def row_logps(logits: torch.Tensor, targets: torch.Tensor, lm_loss_sum) -> torch.Tensor:
    """Each row's summed log-probability of its targets (-100 ignored), through the engine's token loss."""
    return -torch.stack([lm_loss_sum(logits[i:i + 1], targets[i:i + 1]) for i in range(logits.shape[0])])


@dataclass
class PreferenceObjective(Objective):
    beta: float = 0.1
    label_smoothing: float = 0.0

    def forward(self, module, mb):
        return super().forward(module, {k: v for k, v in mb.items() if k != REF_LOGPS})

    def _lm_sum(self, output, mb) -> torch.Tensor:
        """The DPO loss summed over the micro-batch's pairs."""
        logits = output.logits if hasattr(output, "logits") else output
        if logits.shape[0] % 2:
            raise ValueError(f"a preference micro-batch of {logits.shape[0]} rows: rows come in (chosen, rejected) "
                             "pairs, so every micro-batch holds an even number (train_micro_batch_size_per_gpu)")
        logps = row_logps(logits, self.targets(mb), self.lm_loss_sum)
        ref = mb[REF_LOGPS].to(logps)
        margin = (logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2])
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(self.beta * margin) - eps * F.logsigmoid(-self.beta * margin)
        return losses.sum()

    def check_context_parallel(self) -> None:
        raise ValueError("train.objective dpo with context parallelism: a row's log-probability would be summed "
                         "over this rank's share of its tokens only; train DPO without context_parallel")

    def tokens(self, micro: list) -> torch.Tensor:
        """What the loss is a mean over: the pairs (a 1-element fp64 device tensor)."""
        pairs = sum(mb["input_ids"].shape[0] // 2 for mb in micro)
        return torch.full((1,), float(pairs), dtype=torch.float64, device=micro[0]["input_ids"].device)


def objective_for(engine, batch) -> Objective:
    """The engine's objective for `batch`: with train.objective dpo the preference loss, else make_objective's."""
    cfg = engine.cfg
    if cfg.train.objective != "dpo":
        return make_objective(batch, engine.loss_fn, engine._lm_loss_sum, engine.module)
    if not isinstance(batch, dict) or REF_LOGPS not in batch:
        raise ValueError(f"train.objective dpo trains on preference batches: dicts of input_ids, labels and "
                         f"{REF_LOGPS!r} (each row's reference log-probability), rows in (chosen, rejected) pairs")
    if engine.loss_fn is not None:
        raise ValueError("train.objective dpo computes its own loss: drop loss_fn from bunsan.initialize")
    base = make_objective({k: v for k, v in batch.items() if k != REF_LOGPS}, None, engine._lm_loss_sum,
                          engine.module)
    return PreferenceObjective(True, base.lm_loss_sum, None, keywords=base.keywords, shift=base.shift,
                               use_cache=base.use_cache, beta=cfg.dpo.beta, label_smoothing=cfg.dpo.label_smoothing)


@torch.no_grad()
def sequence_logps(engine, batch) -> torch.Tensor:
    """Each row's summed log-probability of its trained targets under the engine's model as it is now (the
    reference of a DPO run, before its first step): a forward of the whole per-rank batch, any layout but a
    pipeline's. Every rank of the engine calls it (ZeRO-3 gathers and tensor-parallel heads are collectives)."""
    if engine.pipe is not None:
        raise ValueError("train.objective dpo with pipeline stages: the reference log-probs need every row's "
                         "logits in one place; train DPO without pipeline.stages")
    plain = {k: v for k, v in batch.items() if k != REF_LOGPS}
    objective = make_objective(plain, None, engine._lm_loss_sum, engine.module)
    mb = split(plain, 1, engine.device)[0]
    was_training = engine.module.training
    engine.module.eval()
    try:
        with engine._logits_for(objective):
            output = objective.forward(engine.module, mb)
            logits = output.logits if hasattr(output, "logits") else output
            return row_logps(logits, objective.targets(mb), engine._lm_loss_sum).double()
    finally:
        engine.module.train(was_training)
