"""Packed rows: several documents in one training row, each computed as if it were alone (positions that
restart at each document, attention that stays inside it)."""

from __future__ import annotations

import torch

__all__ = ["document_positions", "DocumentMask", "packed_forward"]


def packed_forward(model, input_ids: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """A Llama's logits over packed rows: `documents` [b, s] gives each position's document."""
    if documents.shape != input_ids.shape:
        raise ValueError(f"documents {tuple(documents.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    if documents.shape[1] > model.rope_cos.shape[0]:   # (a document is at most its row: no device read)
        raise ValueError(f"packed rows of {documents.shape[1]} tokens exceed max_position_embeddings "
                         f"{model.rope_cos.shape[0]}")
    positions = document_positions(documents)
    cos, sin = model.rope_cos[positions][:, None], model.rope_sin[positions][:, None]
    mask = DocumentMask(documents)
    x = model.embed_tokens(input_ids)
    for layer in model.layers:
        x = layer(x, cos, sin, mask)
    return model.lm_head(model.norm(x))


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: 0 where the document id changes, counting up after."""
    b, s = documents.shape
    index = torch.arange(s, device=documents.device).expand(b, s)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    start_of = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - start_of


class DocumentMask:
    """Attention of packed rows: a query sees the keys of its own document up to itself. Handed to attention
    where a KV cache layer goes (it keeps no keys: update returns them as they are)."""

    def __init__(self, documents: torch.Tensor):
        s = documents.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
        self.attn_mask = (documents[:, :, None] == documents[:, None, :])[:, None] & causal

    @staticmethod
    def update(k: torch.Tensor, v: torch.Tensor):
        return k, v
