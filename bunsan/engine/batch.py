"""What a batch is to the engine, in one place: a language-model dict or an (inputs..., target) tuple, and
how one micro-batch becomes the loss to differentiate and the loss to report (`Objective`).

A language-model batch is a dict with `input_ids` and `labels` (labels already shifted, -100 ignored); with
no `loss_fn` the engine's loss is the mean over the tokens of the whole global batch, so every token weighs
the same whatever its micro-batch or rank. Anything else goes through the user's `loss_fn(output, target)`,
a mean per micro-batch, and the step averages those means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LM_KEYS = ("input_ids", "labels")


def check_keys(batch) -> None:
    """A dict batch holds exactly the keys the model is fed: an extra key would be silently dropped."""
    if isinstance(batch, dict):
        missing = [k for k in LM_KEYS if k not in batch]
        extra = sorted(set(batch) - set(LM_KEYS))
        if missing or extra:
            raise ValueError(f"batch keys {sorted(batch)}: bunsan feeds the model input_ids and computes the loss "
                             f"from labels, so a dict batch holds exactly those"
                             + (f" (missing {missing})" if missing else "")
                             + (f"; {extra} would be ignored: drop them, or pass (inputs..., target) tuples with "
                                "a loss_fn" if extra else ""))


def tensors_of(batch) -> list[torch.Tensor]:
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def rows_of(batch) -> set[int]:
    return {t.shape[0] for t in tensors_of(batch)}


def split(batch, pieces: int, device: torch.device) -> list:
    """`batch` on `device`, cut along dim 0 into `pieces` micro-batches of the same kind (dict or tuple)."""
    if isinstance(batch, dict):
        chunks = {k: v.to(device, non_blocking=True).chunk(pieces) for k, v in batch.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(len(next(iter(chunks.values()))))]
    chunks = [t.to(device, non_blocking=True).chunk(pieces) for t in batch]
    return [tuple(c[i] for c in chunks) for i in range(len(chunks[0]))]


def model_inputs(mb) -> tuple:
    return (mb["input_ids"],) if isinstance(mb, dict) else tuple(mb[:-1])


def target(mb) -> torch.Tensor:
    return mb["labels"] if isinstance(mb, dict) else mb[-1]


def token_count(micro: list) -> torch.Tensor:
    """Labels that count (not -100) over these micro-batches: a 1-element fp64 device tensor."""
    return torch.stack([(mb["labels"] != -100).sum() for mb in micro]).sum().double().reshape(1)


@dataclass
class Objective:
    """The loss of one micro-batch: (what backward differentiates, what is reported).

    lm: the engine's token-summed LM loss (`lm_loss_sum(logits, labels)`), divided by the global token count
    `div`; else the user's `loss_fn` (a mean), divided by the micro-batch count. `scale` is fp16's loss
    scale. `post_scale` is what the reduced gradients are multiplied by before the step: data-parallel
    reduction sums, so a mean over micro-batch means needs 1/dp, while a global token mean is complete.
    """

    lm: bool
    lm_loss_sum: Callable | None
    loss_fn: Callable | None
    div: torch.Tensor | float = 1.0
    scale: float = 1.0
    post_scale: float = 1.0

    def __call__(self, output, mb) -> tuple[torch.Tensor, torch.Tensor]:
        reported = self.lm_loss_sum(output, mb["labels"]) if self.lm else self.loss_fn(output, target(mb))
        loss = reported / self.div
        return (loss * self.scale if self.scale != 1.0 else loss), reported

    def first_input(self, mb) -> torch.Tensor:
        """What the first pipeline stage is fed (a pipeline carries one activation tensor between stages)."""
        inputs = model_inputs(mb)
        if len(inputs) != 1:
            raise ValueError(f"a pipeline feeds its first stage one tensor; this batch has {len(inputs)} inputs: "
                             "pass (input, target) tuples")
        return inputs[0]

    def seq_len(self, mb) -> int:
        """Tokens per row (the pipeline's activation shape); 0 when the batch is not a language-model one."""
        return mb["input_ids"].shape[1] if self.lm else 0

    def summed(self, output, mb) -> torch.Tensor:
        """Evaluation: the loss summed over what it averages (tokens, or rows for a loss_fn's mean)."""
        if self.lm:
            return self.lm_loss_sum(output, mb["labels"])
        return self.loss_fn(output, target(mb)) * target(mb).shape[0]

    def count(self, micro: list) -> torch.Tensor:
        """Evaluation's divisor for `summed`: tokens, or rows."""
        if self.lm:
            return token_count(micro)
        rows = sum(target(mb).shape[0] for mb in micro)
        return torch.full((1,), float(rows), dtype=torch.float64, device=target(micro[0]).device)


def make_objective(batch, loss_fn, lm_loss_sum) -> Objective:
    """The objective for this kind of batch; refuses a batch the engine cannot honour."""
    check_keys(batch)
    lm = isinstance(batch, dict) and loss_fn is None
    if not lm and loss_fn is None:
        raise ValueError("pass loss_fn to bunsan.initialize for batches that are not language-model dicts")
    return Objective(lm, lm_loss_sum, loss_fn)
