"""`bunsan train --init-from DIR` for a transformers causal LM that is not a Llama (Qwen2/3, Mistral, Gemma,
Phi-3, GPT-2, ...) or a vision- or audio-language model (LLaVA, Qwen2-VL, Qwen2-Audio, ...): transformers builds
it from the directory, weights included, and it trains through the same engine as the Python API's
`bunsan.initialize(AutoModelForCausalLM.from_pretrained(DIR), config)`. A composite model (its config has a
vision or audio part), or any model given multimodal records, is built as a whole multimodal LM
(AutoModelForMultimodalLM: the class its image-text-to-text or audio pipeline builds), never its text half.

bunsan's batches carry their targets already shifted; a transformers model reads `labels` unshifted, so they
reach it as `shift_labels` (engine/batch.py). A Llama directory keeps bunsan's own Llama (training/loop.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from bunsan.models.llama_config import LlamaConfig
from bunsan.models.model_dir import read_json

__all__ = ["HFShape", "is_other_architecture", "load_hf_model", "use_shift_labels"]


def is_other_architecture(path) -> bool:
    """A Hugging Face directory whose model_type is not llama (which bunsan's own Llama runs) nor a Mixtral
    bunsan's Llama holds (its MoE blocks in Mixtral's form: models/mixtral_form.py, so expert and tensor
    parallelism split it); False without a config.json, and one that is not a JSON object is refused naming it
    (models/model_dir.py)."""
    config = Path(path) / "config.json"
    data = read_json(config) if os.path.lexists(config) else {}
    if data.get("model_type") == "mixtral":
        try:
            LlamaConfig.from_hf(data)
        except (TypeError, ValueError):      # (a sliding window, router noise: transformers' own model runs it)
            return True
        return False
    return data.get("model_type", "llama") != "llama" and "model_type" in data


@dataclass
class HFShape:
    """What the run's meters and outputs read of the model (LlamaConfig's names): its size, for MFU."""
    hf_config: dict
    total: int
    embedding: int
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_dim: int          # the query heads' width (heads x head_dim): the h of attention's 12·L·h·s
    unrouted: int = 0           # a mixture of experts: the routed experts' parameters one token does not pass

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        total = self.total - (self.unrouted if active else 0)
        return total if include_embedding or self.tie_word_embeddings else total - self.embedding

    def to_hf(self) -> dict:
        return dict(self.hf_config)


def _positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def model_class(config, multimodal: bool):
    """The transformers class that builds the directory's model for training on next tokens."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    kind = config.model_type
    composite = any(getattr(config, k, None) is not None for k in ("vision_config", "audio_config"))
    if (multimodal or composite) and kind in auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForMultimodalLM
    if kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    if multimodal:
        raise ValueError(f"multimodal records with train.init_from a {kind!r} model, which transformers knows no "
                         "multimodal LM class for; set train.init_from to a vision- or audio-language model")
    if kind in auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForMultimodalLM
    recorded = [a for a in (getattr(config, "architectures", None) or [])
                if a.endswith(("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")) and hasattr(transformers, a)]
    if recorded:
        return getattr(transformers, recorded[0])
    raise ValueError(f"model_type {kind!r} (architectures {getattr(config, 'architectures', None)}) is no causal or "
                     "multimodal LM transformers knows; train.init_from takes a model that predicts next tokens")


def load_hf_model(path, cfg, vocab_size: int, multimodal: bool = False) -> tuple[nn.Module, HFShape]:
    """The model of a transformers directory in fp32 on the host (the engine casts and places it), checked
    against the data: its vocabulary holds the tokenizer's, its positions the rows. `multimodal`: the records
    carry images or audio."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"train.init_from {path} is not a Llama: training it needs transformers "
                         "(pip install transformers)") from None
    if cfg.data.packing:
        raise ValueError(f"data.packing with train.init_from {path} (model_type "
                         f"{transformers.AutoConfig.from_pretrained(path).model_type}): the packed rows' document "
                         "boundaries reach bunsan's own Llama only; set data.packing false (one example per row)")
    model = model_class(transformers.AutoConfig.from_pretrained(path), multimodal).from_pretrained(
        path, dtype=torch.float32)
    # a composite model's sizes are its language model's (get_text_config: the config itself for a text model)
    config = model.config.get_text_config()
    positions = _positions(config)
    if config.vocab_size < vocab_size or (positions is not None and positions < cfg.data.seq_len):
        raise ValueError(f"{path} has vocab_size {config.vocab_size} and {positions} positions; the data needs at "
                         f"least {vocab_size} and {cfg.data.seq_len}: use its tokenizer (data.tokenizer) or a "
                         "shorter data.seq_len")
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight     # (as built, whatever config)
    heads = getattr(config, "num_attention_heads", None)        # (transformers maps GPT-2's n_head to it)
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads) if heads else config.hidden_size
    shape = HFShape(model.config.to_dict(), sum(p.numel() for p in model.parameters()), embedding,
                    config.num_hidden_layers, config.hidden_size, config.vocab_size, tied, width,
                    unrouted_parameters(model))
    return model, shape


def unrouted_parameters(model: nn.Module) -> int:
    """Of a transformers mixture of experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek: num_experts_per_tok of
    num_local_experts / num_experts / n_routed_experts), the routed experts' parameters a token does not pass:
    (1 - k / E) of those under an `experts` module; 0 for a dense model."""
    config = model.config
    k = getattr(config, "num_experts_per_tok", None)
    experts = next((v for name in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(v := getattr(config, name, None), int) and v > 0), None)
    if not isinstance(k, int) or experts is None or k >= experts:
        return 0
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
    return routed * (experts - k) // experts


def use_shift_labels(*batches) -> None:
    """The batches give their (shifted) targets as transformers' `shift_labels`."""
    for b in batches:
        if b is not None:
            b.target_key = "shift_labels"
