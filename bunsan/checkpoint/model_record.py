"""The model's config as a checkpoint's meta.json records it (read back by `bunsan convert` and resharding)."""

from __future__ import annotations

import dataclasses

from bunsan.models.llama_config import LlamaConfig
from bunsan.models.mixtral_form import mixtral_problems


def model_record(engine) -> dict | None:
    """The model's config in Hugging Face's form (bunsan's Llama converts its own; a transformers model's is
    its config.to_dict()), for `bunsan convert --to hf`."""
    cfg = getattr(engine.module, "config", None)
    if isinstance(cfg, LlamaConfig) and cfg.moe is not None and mixtral_problems(cfg.moe_config()):
        # a MoE block transformers' Mixtral cannot hold: bunsan's own fields, which LlamaConfig.from_hf reads
        # back (`bunsan convert --to hf` refuses it, naming the field)
        return {**dataclasses.asdict(cfg), "model_type": "llama"}
    if hasattr(cfg, "to_hf"):
        return cfg.to_hf()
    if hasattr(cfg, "to_dict") and hasattr(cfg, "model_type"):
        return {**cfg.to_dict(), "architectures": [getattr(engine.module, "architecture", None) or
                                                   type(engine.module).__name__]}
    return None
