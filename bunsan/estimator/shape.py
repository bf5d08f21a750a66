"""What the estimator needs to know about a model: its parameters, and for a Llama its shape.

A model comes from a preset name, a Hugging Face `config.json` (or the directory
holding one), a `LlamaConfig`, or any `nn.Module` (build it on the meta device:
nothing is allocated). `rank_params` then says which parameters, at what size, one
rank holds under tensor and pipeline parallelism: it cuts the real (meta) model with
the same plan and partitioner training uses (a transformers model split by the engine's
own layers: hf_split.py), so the estimate cannot drift from them (rank_params.py).
"""

from __future__ import annotations

import collections
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from bunsan.models.blocks import repeated_blocks
from bunsan.models.llama import Llama, LlamaConfig
from bunsan.models.model_dir import ROLES, read_json
from bunsan.models.presets import get_preset
from bunsan.pipeline.partition import encoder_paths


@dataclass
class ModelShape:
    name: str
    module: nn.Module                 # on the meta device
    llama: LlamaConfig | None = None  # the shape activations are computed from; None for other modules
    bare: bool = False                # known only by its parameter count: model states only, no activations
    # a transformers model whose blocks save what a Llama block of this shape saves (transforms/saving_forms.py
    # puts them in bunsan's forms): its activations are priced as that Llama's
    blocks_as: LlamaConfig | None = None
    # what the price leaves out (no LM head, a class transformers lacks), each said in `name` as well, which
    # `bunsan estimate` and `plan` print as the model's title
    caveats: tuple[str, ...] = ()
    unpriced_encoders: str = ""       # a composite model's encoders whose activations are not priced, said in full
    tp_encoders: str = "split"        # tensor_parallel.encoders: a composite model's towers split over tp, or whole
    # a Llama-form language model (blocks_as, an LM head, no encoders): its step is priced as that Llama's; the
    # tokens its attention looks back over where that is a sliding window (Mistral's), else None
    steps_as_llama: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False             # blocks_as with an RMSNorm on each q and k head (QK_NORM_BLOCKS: Qwen3)

    @property
    def priced_as(self) -> LlamaConfig | None:
        """The Llama shape whose activations this model's are (bunsan's Llama, or blocks_as)."""
        return self.llama or self.blocks_as

    def timed_as(self, seq_len: int) -> LlamaConfig | None:
        """The Llama shape whose step time the planner prices for rows of `seq_len` tokens: bunsan's Llama, or
        a Llama-form language model's (its blocks run the same GEMMs and attention; whole steps measure within 4%
        of bunsan's Llama's in fp32 on a CPU, Qwen3's 8% over with its q/k norms' passes: benchmarks/
        bench_hf_blocks.py; on a GPU, scripts/gpu-check's "transformers blocks" row); None for any other model, a
        composite one (its encoders' compute depends on the media per sample) and rows longer than a sliding
        window (whose attention computes less than the causal square priced)."""
        if self.llama is not None:
            return self.llama
        if not self.steps_as_llama or (self.sliding_window is not None and seq_len > self.sliding_window):
            return None
        return self.blocks_as

    def untimed_why(self, seq_len: int) -> str:
        """Why timed_as(seq_len) is None, said for `bunsan plan`'s closing line."""
        if self.blocks_as is None:
            return "its blocks are not one of estimator/shape.py's LLAMA_FORM_BLOCKS"
        if self.unpriced_encoders:
            return "its encoders' compute depends on the images or clips per sample"
        if not self.steps_as_llama:
            return "it has no LM head"
        return (f"its attention's sliding window of {self.sliding_window} tokens is shorter than the {seq_len}-token "
                "rows, where it computes less than the causal square the cost model prices")

    @functools.cached_property
    def n_params(self) -> int:     # (cached: the planner asks once per layout; the module is not changed)
        return sum(p.numel() for p in self.module.parameters())

    @functools.cached_property
    def n_frozen(self) -> int:
        """Elements that do not train (a frozen encoder): held as weights, with no gradients or optimizer states."""
        return sum(p.numel() for p in self.module.parameters() if not p.requires_grad)


def _llama_shape(cfg: LlamaConfig, name: str) -> ModelShape:
    with torch.device("meta"):
        return ModelShape(name, Llama(cfg), cfg, caveats=(MOE_BALANCED,) if cfg.moe is not None else ())


# what a MoE block computes, keeps and sends depends on where the router sends the tokens: priced at the even split
MOE_BALANCED = "a mixture of experts priced with balanced routing (the busiest expert's rank computes and sends more)"


_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmbt])\s*$", re.IGNORECASE)
_SCALE = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


# A bare count is priced as a Llama-2-style shape (models/presets.py's 7b: hidden 4096, 32 layers, head dim
# 128, SwiGLU at 8h/3): hidden / layers = 128 as in Llama-2 7B and 13B, the vocabulary absorbing the rest.
ASPECT, HEAD_DIM, VOCAB = 128, 128, 32000


def llama_of_count(count: int) -> LlamaConfig:
    """A Llama shape with `count` parameters (to within two hidden rows): its blocks are ZeRO-3's units and
    its largest weight the per-tensor transients, where one tensor of `count` elements would be neither."""
    def block(h: int) -> int:
        inter = max(256, round(8 * h / 3 / 256) * 256)
        return 4 * h * h + 3 * h * inter + 2 * h

    best = None
    for step in (1024, 128):     # heads a multiple of 8 where the count allows: every tensor-parallel size fits
        for h in range(step, 65537, step):
            layers = round((count - 2 * VOCAB * h) / block(h))
            if layers >= 1 and (best is None or abs(layers - h / ASPECT) < abs(best[1] - best[0] / ASPECT)):
                best = (h, layers)
        if best is not None:
            break
    if best is None:
        raise ValueError(f"{count:,} parameters is too few for a Llama shape (under one 128-wide block and a "
                         f"{VOCAB}-token vocabulary); give a preset or a config.json instead")
    h, layers = best
    inter = max(256, round(8 * h / 3 / 256) * 256)
    vocab = max(1, (count - layers * block(h) - h) // (2 * h))
    return LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=max(1, h // HEAD_DIM), max_position_embeddings=4096)


def _bare(count: float, name: str) -> ModelShape:
    """A model known only by its parameter count ("7.5B"): model states of a Llama shape of that count, no
    activations (its sequence and batch are unknown); one tensor when the count is too small for a Llama."""
    try:
        cfg = llama_of_count(int(count))
    except ValueError:
        module = nn.Module()
        module.weight = nn.Parameter(torch.empty(int(count), device="meta"))
        return ModelShape(f"{name} parameters (one tensor: too few for a Llama shape)", module, bare=True)
    with torch.device("meta"):
        module = Llama(cfg)
    label = (f"{name} parameters, priced as a Llama of {cfg.num_hidden_layers} layers x hidden {cfg.hidden_size} "
             f"(intermediate {cfg.intermediate_size}, vocabulary {cfg.vocab_size:,})")
    return ModelShape(label, module, cfg, bare=True)


def load_shape(model, overrides: dict | None = None) -> ModelShape:
    """A ModelShape from a preset name, a config.json path or HF directory, a LlamaConfig, an nn.Module,
    or a bare parameter count such as "7.5B" (model states only)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, LlamaConfig):
        return _llama_shape(model, "llama")
    if isinstance(model, nn.Module):
        cfg = getattr(model, "config", None)
        if isinstance(cfg, LlamaConfig):
            return ModelShape(type(model).__name__, model, cfg)
        return transformers_shape(model)
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a preset name, a config.json path, a LlamaConfig or an nn.Module, "
                        f"got {type(model).__name__}")
    from bunsan.models.presets import canonical_name, presets
    if canonical_name(str(model)) not in presets and (m := _COUNT.match(str(model))):
        return _bare(float(m[1]) * _SCALE[m[2].lower()], str(model))
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not os.path.lexists(path):
            raise FileNotFoundError(f"{model} is a directory without a config.json; point --model at a Hugging "
                                    "Face model directory, its config.json, or a preset name")
    if path.suffix == ".json" and not os.path.lexists(path):
        raise FileNotFoundError(f"model config {path} does not exist; point --model at a Hugging Face model "
                                "directory, its config.json, or a preset name")
    if os.path.lexists(path):
        d = read_json(path, role=ROLES["config.json"])      # (whatever its name: a model's config)
        if d.get("model_type") == "mixtral" and not overrides and (cfg := _as_bunsan_moe(d)) is not None:
            return _llama_shape(cfg, path.parent.name or path.stem)
        if d.get("model_type", "llama") != "llama" or "text_config" in d:     # priced from its own modules
            return _transformers_shape(d, path, overrides)
        return _llama_shape(LlamaConfig.from_hf(d).replace(**(overrides or {})), path.parent.name or path.stem)
    from bunsan.models.presets import build_config
    return _llama_shape(build_config(str(model), **(overrides or {})) if overrides else get_preset(str(model)),
                        str(model))


def _as_bunsan_moe(d: dict) -> LlamaConfig | None:
    """A Mixtral config as the bunsan Llama with MoE blocks that `bunsan train --init-from` trains it as
    (training/hf_model.py), or None where transformers' own model runs it (a sliding window, router noise)."""
    try:
        return LlamaConfig.from_hf(d)
    except (TypeError, ValueError):
        return None


# transformers' auto classes when the config names no class it has, the most complete model first: where a
# model_type maps to several (Whisper: the speech-to-text model, and its decoder alone as a causal LM; Qwen2-Audio:
# the audio-language model, and AutoModel's base without a head), what trains is the whole model with its head
AUTO_CLASSES = ("AutoModelForMultimodalLM", "AutoModelForImageTextToText", "AutoModelForSpeechSeq2Seq",
                "AutoModelForSeq2SeqLM", "AutoModelForCausalLM", "AutoModel")


def _transformers_shape(d: dict, path: Path, overrides: dict | None) -> ModelShape:
    """Another architecture's config.json (Qwen2, Gemma, a LLaVA with its vision tower, ...): the model built by
    transformers on the meta device, so every module it has is counted, none assumed. The class is the one the
    config's `architectures` names (as checkpoint/convert.py builds it), else the first of AUTO_CLASSES that
    builds; what that leaves out (no LM head, a named class this transformers lacks) is said in the name."""
    kind = d.get("model_type")
    if overrides:
        raise ValueError(f"{path}: model_type {kind!r} is priced from the model transformers builds; the model "
                         f"overrides {sorted(overrides)} apply to bunsan's Llama only: drop them")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{path}: model_type {kind!r} is not a Llama; pricing it needs transformers "
                         "(pip install transformers)") from None
    try:
        config = transformers.AutoConfig.for_model(**d)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: transformers does not know model_type {kind!r} ({e}); bunsan prices what "
                         "transformers can build") from None
    caveats = []
    named = (d.get("architectures") or [None])[0]
    cls = getattr(transformers, named, None) if isinstance(named, str) else None
    if isinstance(named, str) and cls is None:
        caveats.append(f"config.architectures names {named}, which this transformers does not have: priced as "
                       "the class transformers maps model_type to")
    with torch.device("meta"):
        model = None
        if cls is not None:
            try:
                model = cls(config)
            except Exception as e:   # noqa: BLE001  (any class's refusal of the config: said, then the auto classes)
                caveats.append(f"{named} does not build from this config ({type(e).__name__}: {str(e)[:120]}): "
                               "priced as the class transformers maps model_type to")
        for auto in AUTO_CLASSES if model is None else ():
            builder = getattr(transformers, auto, None)
            try:
                model = builder.from_config(config) if builder is not None else None
            except ValueError:          # model_type not in this auto class's mapping
                continue
            if model is not None:
                break
    if model is None:
        raise ValueError(f"{path}: transformers builds no model for model_type {kind!r}; bunsan cannot price it")
    if _head(model) is None:
        caveats.append(f"no LM head: {type(model).__name__} is the base model, a head trained on it is not counted; "
                       "give the config's architectures the class you train")
    return transformers_shape(model, caveats)


def transformers_shape(model: nn.Module, caveats: list[str] | tuple[str, ...] = ()) -> ModelShape:
    """A ModelShape of a module other than bunsan's Llama (a transformers model, any nn.Module), with the
    caveats its price carries in its name: what it leaves out, such as a composite model's encoders."""
    text = _text_config(getattr(model, "config", None))      # (the language model's config)
    blocks_as = _llama_form_blocks(text)
    towers = encoder_paths(model) if blocks_as is not None else []
    caveats = tuple(caveats) + ((f"NOT PRICED: the activations of {', '.join(towers)}",) if towers else ())
    name = type(model).__name__
    if caveats:
        name += " (" + "; ".join(caveats) + ")"
    return ModelShape(name, model, None, blocks_as=blocks_as, caveats=caveats,
                      unpriced_encoders=_unpriced_encoders(model, towers) if towers else "",
                      steps_as_llama=blocks_as is not None and not towers and _head(model) is not None,
                      sliding_window=_sliding_window(text),
                      qk_norm=blocks_as is not None and getattr(text, "model_type", None) in QK_NORM_BLOCKS)


def _unpriced_encoders(model: nn.Module, towers: list[str]) -> str:
    """What a composite model's price leaves out: its encoders' activations. Their tokens are the images' patches
    or the clips' frames, so what they save depends on the media per sample, which a layout does not say."""
    blocks = repeated_blocks(model)
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}    # (Qwen2-Audio lists its attention too)
    said = []
    for path in towers:
        tower = set(map(id, model.get_submodule(path).modules()))
        kinds = collections.Counter(type(b).__name__ for b in blocks if id(b) in tower and id(b) not in inner)
        said.append(f"{path} ({', '.join(f'{n} {k}' for k, n in kinds.items())})" if kinds else path)
    return (f"the activations of {'; '.join(said)}: they depend on the images or clips per sample; the language "
            "model's blocks are priced, the peak is a floor (measure a step: engine.memory_report())")


def _head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


# model types (of the language model: a composite model's text_config) whose decoder layers, in the saving forms,
# save a Llama block's bytes (measured within 2%: tests/test_activation_bound.py; Qwen2-VL's and Qwen2.5-VL's
# multimodal rotary embedding is made once per forward, not per block), and with QK_NORM_BLOCKS' q/k norms their
# inputs besides (activations.Micro.qk_norm); Gemma 2's eager softcapped attention saves more
LLAMA_FORM_BLOCKS = ("llama", "qwen2", "mistral", "gemma", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3")
QK_NORM_BLOCKS = ("qwen3",)


def _llama_form_blocks(config) -> LlamaConfig | None:
    """The Llama shape of a LLAMA_FORM_BLOCKS language model's blocks (`config`: a composite model's
    text_config, its head_dim as it says: Qwen3's and Gemma 7B's are apart from hidden / heads); None for any
    other model."""
    if getattr(config, "model_type", None) not in LLAMA_FORM_BLOCKS:
        return None
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                       num_attention_heads=config.num_attention_heads, head_dim=getattr(config, "head_dim", None),
                       num_key_value_heads=getattr(config, "num_key_value_heads", None),
                       max_position_embeddings=config.max_position_embeddings,
                       tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def _text_config(config):
    """A config's language model's (a composite model's text_config; the config itself otherwise)."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _sliding_window(config) -> int | None:
    """The tokens a language model's attention looks back over where it is a sliding window (Mistral's
    `sliding_window`; Qwen2's only with `use_sliding_window`), else None."""
    if config is None or getattr(config, "use_sliding_window", True) is False:
        return None
    kinds = getattr(config, "layer_types", None)        # (Qwen2's max_window_layers: the layers that slide)
    if isinstance(kinds, (list, tuple)) and "sliding_attention" not in kinds:
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None
