"""Batches of multimodal chat rows: the example rows' ids and labels (example_batches.py) with each picked row's
media as its processor makes them, run again at batch time (rows keep where their media is, media_chat.py).

A batch holds the rows' media tensors as the processor would for them together: one entry per token
(mm_token_type_ids) padded and cut as the row's ids, and everything else (pixel_values, image_grid_thw,
input_features, feature_attention_mask, ...) the rows' entries one after another, in row order, as the model
reads them and the engine cuts them (engine/media.py).
"""

from __future__ import annotations

import torch

from bunsan.training.example_batches import ExampleBatches, ExampleRows
from bunsan.training.media_chat import PER_TOKEN

__all__ = ["MediaBatches", "example_batches", "takes_inputs"]


def example_batches(rows: ExampleRows, *args, **kwargs) -> ExampleBatches:
    return (MediaBatches if rows.media is not None else ExampleBatches)(rows, *args, **kwargs)


def takes_inputs(model_inputs: set[str] | None, *batches) -> None:
    """The model's keyword inputs: a per-token key it does not take (LLaVA's forward names no mm_token_type_ids)
    is left out of its batches; any other key it does not take stays, for the engine to refuse by name."""
    for b in batches:
        if isinstance(b, MediaBatches):
            b.model_inputs = model_inputs


class MediaBatches(ExampleBatches):
    model_inputs: set[str] | None = None

    def __init__(self, rows: ExampleRows, *args, **kwargs):
        super().__init__(rows, *args, **kwargs)
        self.specs, self.chat = rows.media, rows.media_chat

    def batch_at(self, position: int) -> dict[str, torch.Tensor]:
        batch = super().batch_at(position)
        ids = batch["input_ids"]
        picked = self.window_ids(position)
        per_row = [self.chat.tensors(self.specs[i], ids[r]) for r, i in enumerate(picked)]
        batch.update(self._joined(per_row, ids.shape[1]))
        return batch

    def _joined(self, per_row: list[dict], width: int) -> dict[str, torch.Tensor]:
        out = {}
        keys = list(dict.fromkeys(k for media in per_row for k in media))
        for key in keys:
            if key in PER_TOKEN:
                if self.model_inputs is not None and key not in self.model_inputs:
                    continue
                rows = torch.zeros(len(per_row), width, dtype=torch.long)
                for r, media in enumerate(per_row):
                    if key in media:
                        got = media[key][0, :width]
                        rows[r, :len(got)] = got
                out[key] = rows
                continue
            parts = [media[key] for media in per_row if key in media]
            if len({tuple(p.shape[1:]) for p in parts}) > 1:
                raise ValueError(f"{key}: the rows' entries have different shapes "
                                 f"{sorted({tuple(p.shape) for p in parts})}, which one batch tensor cannot hold; "
                                 "set the processor to one size (its size / max_pixels) or train one row per batch")
            out[key] = torch.cat(parts)
        return out
