"""Named model shapes: tiny/small for tests and CPU runs, public Llama shapes for estimates."""
from __future__ import annotations

import copy
import dataclasses
import difflib

from bunsan.models.llama import LlamaConfig

_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_LLAMA31_SCALING = {**_LLAMA3_SCALING, "factor": 8.0}


def _llama31(hidden: int, layers: int, heads: int, intermediate: int) -> LlamaConfig:
    """meta-llama/Llama-3.1-{8B,70B,405B}'s config.json: 128,256-token vocabulary, 8 KV heads, 128K positions."""
    return LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                       max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=dict(_LLAMA31_SCALING))


_smollm_135m = LlamaConfig(  # HuggingFaceTB/SmolLM-135M
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
    tie_word_embeddings=True)

presets: dict[str, LlamaConfig] = {
    # ~0.8M params: forward+backward at 8x64 is cheap on a CPU; for tests.
    "tiny": LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    # ~4.5M params, byte vocab: the default job, small enough to learn Python source on a CPU.
    "small": LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
    # ~1.05M params (0.66M active): tiny's attention with 4 experts, top-2, in every block, in transformers'
    # Mixtral form (softmax, renormalised top-k): a mixture of experts for tests and CPU runs
    "tiny-moe": LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            moe={"num_experts": 4, "top_k": 2, "expert_intermediate_size": 128,
                                 "route_norm": True, "aux_loss_coef": 0.01}),
    "135m": _smollm_135m,
    "125m": copy.deepcopy(_smollm_135m),  # alias: the usual "GPT-2 small"-sized name
    "1b": LlamaConfig(  # meta-llama/Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING)),
    # Llama 3 and 3.1 have the same shapes; 3.1's rope scaling and 128K positions are the superset
    "llama3-8b": _llama31(4096, 32, 32, 14336),
    "llama3-70b": _llama31(8192, 80, 64, 28672),
    "llama3-405b": _llama31(16384, 126, 128, 53248),
    "7b": LlamaConfig(  # meta-llama/Llama-2-7b-hf
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "13b": LlamaConfig(  # meta-llama/Llama-2-13b-hf
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
    "70b": LlamaConfig(  # meta-llama/Llama-2-70b-hf
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096),
}


def canonical_name(name: str) -> str:
    """The preset key of a name, accepting the usual prefixes: llama-13b, llama2-7b, llama-3.2-1b -> 13b, 7b, 1b;
    Llama-3.1-8B, llama-3-70b, meta-llama-3.1-405b -> llama3-8b, llama3-70b, llama3-405b."""
    key = str(name).lower().removeprefix("meta-")
    for prefix in ("llama-3.1-", "llama3.1-", "llama-3-"):
        if key.startswith(prefix) and f"llama3-{key[len(prefix):]}" in presets:
            return f"llama3-{key[len(prefix):]}"
    for prefix in ("llama-3.2-", "llama3.2-", "llama-2-", "llama2-", "llama-"):
        if key.startswith(prefix) and key[len(prefix):] in presets:
            return key[len(prefix):]
    return key


def get_preset(name: str) -> LlamaConfig:
    """A fresh copy of a preset (mutating it never changes ``presets``)."""
    key = canonical_name(name)
    if key not in presets:
        close = difflib.get_close_matches(key, list(presets), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model preset {name!r}{hint}; known presets: {', '.join(presets)}; or give a "
                         "Hugging Face config.json or model directory")
    return copy.deepcopy(presets[key])


def build_config(preset: str, **overrides) -> LlamaConfig:
    """Preset plus field overrides (None values ignored, so unset CLI flags pass through)."""
    base = get_preset(preset)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        hints = [f"{u!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, fields, n=1)) else "")
                 for u in unknown]
        raise ValueError(f"unknown model field(s) {', '.join(hints)}; valid: {', '.join(sorted(fields))}")
    if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides \
            and base.num_key_value_heads == base.num_attention_heads:
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]  # keep MHA presets MHA
    return base.replace(**overrides)
