"""Where a transformers model keeps its parts: its decoder laid out as Llama's (embed_tokens, layers, norm,
rotary_emb), and beside a multimodal model's language model its encoders and projector. Read by the pipeline
cut, tensor parallelism's encoder plans, the estimator and serving alike."""

from __future__ import annotations

import torch.nn as nn


def _decoder_shaped(base) -> bool:
    has = all(isinstance(getattr(base, a, None), nn.Module) for a in ("embed_tokens", "norm", "rotary_emb"))
    return has and isinstance(getattr(base, "layers", None), nn.ModuleList)


def hf_decoder_prefix(model: nn.Module) -> str | None:
    """The path of a Hugging Face LM's decoder laid out as Llama's (embed_tokens, layers, norm, rotary_emb
    under it; lm_head beside the base model): the base model itself ("model"), or a multimodal model's
    language model inside it ("model.language_model", beside its encoders: hf_composite_base); else None."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if isinstance(prefix, str) else None
    if base is None or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    if _decoder_shaped(base):
        return prefix
    return f"{prefix}.language_model" if _decoder_shaped(getattr(base, "language_model", None)) else None


def hf_composite_base(model: nn.Module) -> str | None:
    """A multimodal model's base (LLaVA's, Qwen2-VL's: encoders, projector and a language model) path, else None."""
    prefix = hf_decoder_prefix(model)
    return prefix.rpartition(".")[0] if prefix and prefix.endswith(".language_model") else None


def encoder_paths(model: nn.Module) -> list[str]:
    """A multimodal model's modules beside its language model (vision or audio tower, projector): the first
    pipeline layer's, with the embedding, since they make the decoder's input."""
    base = hf_composite_base(model)
    if base is None:
        return []
    return [f"{base}.{n}" for n, m in model.get_submodule(base).named_children()
            if n != "language_model" and any(True for _ in m.parameters())]
