"""What a batch is to the engine, in one place: a language-model dict or an (inputs..., target) tuple, how a
micro-batch is fed to the model, and how its output becomes the loss to differentiate and the loss to report
(`Objective`).

Language-model dicts come in two conventions:

  bunsan's      {"input_ids", "labels"}: labels already shifted (labels[t] is the target of position t),
                -100 ignored; for bunsan's Llama (and any model called as model(input_ids) returning logits).
  Hugging Face  for a model whose forward takes keywords (a transformers PreTrainedModel): every key reaches
                model(**batch) (attention_mask, position_ids, ...); "labels" are HF's, unshifted (labels =
                input_ids, the shift happens here, as inside HF's loss), or "shift_labels" are already
                shifted (HF's name for bunsan's form). A key the forward does not name is an error.

Either way the loss is the mean over the tokens of the whole global batch, so every token weighs the same
whatever its micro-batch or rank (HF's loss with num_items_in_batch = the global count). Anything else goes
through the user's `loss_fn(output, target)`, a mean per micro-batch, and the step averages those means.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from bunsan.engine.media import grouped, refuse_media_under_cp, row_keys, split_media

LM_KEYS = ("input_ids", "labels")
DOCUMENTS = "document_ids"    # packed rows: each position's document (a model with takes_documents reads it)
HF_TARGETS = ("labels", "shift_labels")


def without_kv_cache(module, kwargs: dict) -> dict:
    """The keywords of a DeepSpeed-style `engine(**batch)` call: a transformers model training (grad on, train
    mode) gets use_cache=False unless the caller chose, as train_batch's Objective passes. Its KV cache is state
    the forward changes: selective recompute finds it changed and stops ("not found in storage"), and a
    training step has no use for it."""
    if "use_cache" in kwargs or not (module.training and torch.is_grad_enabled()):
        return kwargs
    accepted = keyword_inputs(module)
    return {**kwargs, "use_cache": False} if accepted is not None and "use_cache" in accepted else kwargs


def keyword_inputs(module) -> set[str] | None:
    """The keyword inputs a Hugging Face-style forward names (None for a model called positionally); a
    pipeline stage of one says its own (pipeline/partition.py)."""
    stage_inputs = getattr(module, "keyword_inputs", None)
    if stage_inputs is not None:
        return set(stage_inputs)
    if not any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__):
        return None
    params = inspect.signature(module.forward).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_keys(batch, accepted: set[str] | None, takes_documents: bool = False) -> None:
    """A dict batch holds exactly what the model is fed: a key it does not take would be silently dropped."""
    if not isinstance(batch, dict):
        return
    if accepted is None:    # a model called as model(input_ids)
        missing = [k for k in LM_KEYS if k not in batch]
        extra = sorted(set(batch) - set(LM_KEYS) - ({DOCUMENTS} if takes_documents else set()))
        if missing or extra:
            raise ValueError(f"batch keys {sorted(batch)}: bunsan feeds this model input_ids and computes the "
                             "loss from labels, so a dict batch holds exactly those"
                             + (f" (missing {missing})" if missing else "")
                             + (f"; {extra} would be ignored: drop them, or pass (inputs..., target) tuples "
                                "with a loss_fn" if extra else ""))
        return
    targets = [k for k in HF_TARGETS if k in batch]
    if len(targets) != 1:
        raise ValueError(f"batch keys {sorted(batch)}: a Hugging Face model's batch holds its targets as "
                         "'labels' (unshifted: labels = input_ids, HF's convention) or 'shift_labels' (already "
                         "shifted), exactly one of them")
    unknown = sorted(set(batch) - accepted - set(HF_TARGETS))
    if unknown:
        raise ValueError(f"batch keys {unknown} are not inputs of the model's forward (it takes "
                         f"{sorted(accepted)}); they would be dropped: remove them")


def tensors_of(batch) -> list[torch.Tensor]:
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def rows_of(batch) -> set[int]:
    """The first dimensions of the tensors that hold one entry per row (a processor's flat patches do not)."""
    if isinstance(batch, dict):
        return {batch[k].shape[0] for k in row_keys(batch)}
    return {t.shape[0] for t in tensors_of(batch)}


def split(batch, pieces: int, device: torch.device) -> list:
    """`batch` on `device`, cut along dim 0 into `pieces` micro-batches of the same kind (dict or tuple); a
    processor's flat patches go with the rows whose images they are (media.py)."""
    if isinstance(batch, dict) and grouped(batch):
        return [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in split_media(batch, pieces)]
    if isinstance(batch, dict):
        chunks = {k: v.to(device, non_blocking=True).chunk(pieces) for k, v in batch.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(len(next(iter(chunks.values()))))]
    chunks = [t.to(device, non_blocking=True).chunk(pieces) for t in batch]
    return [tuple(c[i] for c in chunks) for i in range(len(chunks[0]))]


def check_cut(micro: list, context_parallel: bool, sequence_parallel: bool) -> None:
    """What cannot be cut along the sequence: packed rows (their documents' attention needs the whole row)
    under context or sequence parallelism, and a multimodal batch's media under context parallelism."""
    packed = any(isinstance(mb, dict) and DOCUMENTS in mb for mb in micro)
    if packed and (context_parallel or sequence_parallel):
        raise ValueError("packed rows (document_ids) under context parallelism or sequence parallelism: "
                         "their attention would need the whole row's documents; set data.packing to false "
                         "(one example per row) or train without them")
    if context_parallel:
        refuse_media_under_cp(micro)


def target(mb) -> torch.Tensor:
    """What a loss_fn compares the output with: a tuple's last tensor, a dict's labels (as given: a Hugging
    Face batch's are unshifted) or shift_labels."""
    if not isinstance(mb, dict):
        return mb[-1]
    return mb["labels"] if "labels" in mb else mb["shift_labels"]


@dataclass
class Objective:
    """The loss of one micro-batch: (what backward differentiates, what is reported).

    lm: the engine's token-summed LM loss (`lm_loss_sum(logits, targets)`), divided by the global token count
    `div`; else the user's `loss_fn` (a mean), divided by the micro-batch count. `keywords`: the model takes
    the batch as keywords (Hugging Face); `shift`: its labels are unshifted. `scale` is fp16's loss scale.
    `aux_coef`: a transformers MoE model's router_aux_loss_coef when it sets output_router_logits: each
    micro-batch adds coef x its forward's aux_loss, weighted by its share of the step's tokens (so one forward of
    the whole batch gives what transformers' own loss does: the LM mean + coef x aux).
    `post_scale` is what the reduced gradients are multiplied by before the step: data-parallel reduction
    sums, so a mean over micro-batch means needs 1/dp, while a global token mean is complete.
    """

    lm: bool
    lm_loss_sum: Callable | None
    loss_fn: Callable | None
    keywords: bool = False
    shift: bool = False
    use_cache: bool = False     # the forward takes use_cache: pass False (training keeps no KV cache)
    div: torch.Tensor | float = 1.0
    scale: float = 1.0
    post_scale: float = 1.0
    aux_coef: float = 0.0

    def forward(self, module, mb):
        """The model's output on micro-batch `mb`."""
        if not isinstance(mb, dict):
            return module(*mb[:-1])
        if not self.keywords:
            if DOCUMENTS in mb:
                return module(mb["input_ids"], documents=mb[DOCUMENTS])
            return module(mb["input_ids"])
        inputs = {k: v for k, v in mb.items() if k not in HF_TARGETS}
        return module(**inputs, **({"use_cache": False} if self.use_cache and "use_cache" not in mb else {}))

    def targets(self, mb) -> torch.Tensor:
        """The target of every position, shifted (the last position of an unshifted row has none: -100)."""
        if "shift_labels" in mb:
            return mb["shift_labels"]
        labels = mb["labels"]
        if not self.shift:
            return labels
        return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)

    def _lm_sum(self, output, mb) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        return self.lm_loss_sum(logits, self.targets(mb))

    def _aux_sum(self, output, mb) -> torch.Tensor:
        aux = getattr(output, "aux_loss", None)
        if aux is None:
            raise ValueError("the model sets output_router_logits (its router's auxiliary loss is part of its "
                             "loss) but this forward returned no aux_loss (under pipeline stages the last stage gives "
                             "logits only): set config.output_router_logits to False, or train without pipeline "
                             "stages")
        return self.aux_coef * aux * (self.targets(mb) != -100).sum()

    def __call__(self, output, mb) -> tuple[torch.Tensor, torch.Tensor]:
        reported = self._lm_sum(output, mb) if self.lm else self.loss_fn(output, target(mb))
        if self.lm and self.aux_coef:
            reported = reported + self._aux_sum(output, mb)
        loss = reported / self.div
        return (loss * self.scale if self.scale != 1.0 else loss), reported

    def check_context_parallel(self) -> None:
        """Context parallelism gives each rank a share of every row's tokens: only a sum over tokens survives."""
        if not self.lm:
            raise ValueError("context parallelism trains on language-model dict batches {input_ids, labels} "
                             "with the engine's token-mean loss: a loss_fn would see only this rank's share of "
                             "each row's tokens; pass dict batches without a loss_fn")

    def tokens(self, micro: list) -> torch.Tensor:
        """Targets that count (not -100) over these micro-batches: a 1-element fp64 device tensor."""
        return torch.stack([(self.targets(mb) != -100).sum() for mb in micro]).sum().double().reshape(1)

    def first_input(self, mb) -> torch.Tensor:
        """What the first pipeline stage is fed (a pipeline carries one activation tensor between stages)."""
        if isinstance(mb, dict):
            return mb["input_ids"]
        if len(mb) != 2:
            raise ValueError(f"a pipeline feeds its first stage one tensor; this batch has {len(mb) - 1} inputs: "
                             "pass (input, target) tuples")
        return mb[0]

    def seq_len(self, mb) -> int:
        """Tokens per row (a Llama stage's rope tables): the first input's second dimension, 0 without one."""
        first = self.first_input(mb)
        return first.shape[1] if first.dim() >= 2 else 0

    def summed(self, output, mb) -> torch.Tensor:
        """Evaluation: the loss summed over what it averages (tokens, or rows for a loss_fn's mean)."""
        if self.lm:
            return self._lm_sum(output, mb)
        return self.loss_fn(output, target(mb)) * target(mb).shape[0]

    def count(self, micro: list) -> torch.Tensor:
        """Evaluation's divisor for `summed`: tokens, or rows."""
        if self.lm:
            return self.tokens(micro)
        rows = sum(target(mb).shape[0] for mb in micro)
        return torch.full((1,), float(rows), dtype=torch.float64, device=target(micro[0]).device)


def make_objective(batch, loss_fn, lm_loss_sum, module) -> Objective:
    """The objective for this kind of batch and model; refuses a batch the engine cannot honour."""
    accepted = keyword_inputs(module) if isinstance(batch, dict) else None
    check_keys(batch, accepted, getattr(module, "takes_documents", False))
    lm = isinstance(batch, dict) and loss_fn is None
    if not lm and loss_fn is None:
        raise ValueError("pass loss_fn to bunsan.initialize for batches that are not language-model dicts")
    keywords = accepted is not None
    config = getattr(module, "config", None)
    aux = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) \
        if keywords and getattr(config, "output_router_logits", False) else 0.0
    return Objective(lm, lm_loss_sum, loss_fn, keywords=keywords, shift=keywords and "labels" in batch,
                     use_cache=keywords and "use_cache" in accepted, aux_coef=aux)
