"""A transformers causal LM (Qwen2/3, Mistral, Gemma 2/3, Phi-3, GPT-2, ...) behind the forward `bunsan serve`'s
batcher calls on bunsan's Llama: `model(ids, kv_cache=view)` -> logits [1, tokens, vocab], every row's tokens
flattened at their own positions in the serving KV cache (paged.py).

transformers' own forward runs unchanged but for its attention kernel; its inputs carry the batch's layout:
- the attention function: registered in transformers' AttentionInterface (`bunsan_paged_sdpa`, `_eager`) and
  set on the model; within a serving forward it is the paged cache's attention over each row's blocks (with
  the layer's scaling and softcap, and its sliding window from the config's layer_types), outside one the
  model's own kernel;
- `cache`: an object with transformers' `update(keys, values, layer_idx)`, which passes the new keys and values
  on to the attention function;
- `position_ids`: each token's position (rotary or learned), so a row's 10th token is at 10 whatever the others;
- `attention_mask`: a placeholder 4D mask (used as given, so transformers builds none; the cache masks).

A vision-language model (LLaVA, Qwen2-VL, ...) serves the same way, its language model's attention paged; a
forward holding image tokens passes `inputs_embeds` with their embeddings in (and Qwen2-VL's 3D positions),
which `encode` takes from the model's own base forward, stopped where it hands them to its language model.
"""

from __future__ import annotations

import inspect
import sys
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bunsan.models.hf import cache_keyword, input_device
from bunsan.models.hf_layout import hf_composite_base, hf_decoder_prefix

ATTENTION_KINDS = ("full_attention", "sliding_attention")
ATTENTION_FUNCTIONS = ("sdpa", "eager")      # the kernels the paged attention reproduces
PAGED = "bunsan_paged_"                      # their serving forms' names in transformers' AttentionInterface


@dataclass
class ServedShape:
    """What the server and its KV cache read of the model, by bunsan's (LlamaConfig's) names."""
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int

    @classmethod
    def of(cls, config) -> "ServedShape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        context = getattr(config, "max_position_embeddings", None)
        if not isinstance(context, int):
            raise ValueError(f"{config.model_type}'s config has no max_position_embeddings; pass --context")
        return cls(config.model_type, config.vocab_size, config.hidden_size, config.num_hidden_layers, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, context)


def attention_function(config) -> str:
    """The attention kernel the model was loaded with ("sdpa", "eager", ...), also once served."""
    return (getattr(config, "_attn_implementation", None) or "sdpa").removeprefix(PAGED)


def attention_layout(config) -> tuple[list[str], int | None]:
    """(each layer's attention kind, the sliding window) from the config, refusing what the serving mask
    cannot express (chunked or linear attention layers, flash or flex kernels)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = list(getattr(config, "layer_types", None) or
                 ["sliding_attention" if window else "full_attention"] * layers)
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
    if unknown:
        raise ValueError(f"{config.model_type}: layer types {unknown} are not served (bunsan serve masks "
                         f"{' and '.join(ATTENTION_KINDS)} layers); serve a model with those only")
    if "sliding_attention" in kinds and not window:
        raise ValueError(f"{config.model_type}: sliding_attention layers without a sliding_window in the config")
    implementation = attention_function(config)
    if implementation not in ATTENTION_FUNCTIONS:
        raise ValueError(f"{config.model_type} uses attn_implementation {implementation!r}; bunsan serve passes "
                         f"a 4D mask, which {' and '.join(ATTENTION_FUNCTIONS)} take: load it with one of those")
    return kinds, window


class _RowsCache:
    """transformers' cache interface over one forward's view of the serving cache (paged.py's PagedView): the
    new keys and values pass through; the attention function below writes and reads the blocks."""

    is_compileable = False

    def __init__(self, view):
        self.view = view

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.view.at.min())


_serving: ContextVar = ContextVar("bunsan_serving_view", default=None)   # the view of the forward under way


def _paged_attention(original: str):
    """An attention function for transformers' AttentionInterface: within a serving forward, the paged cache's
    attention over each row's blocks; outside one (an embeddings request's plain forward), the model's own."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        view = _serving.get()
        if view is None:
            own = ALL_ATTENTION_FUNCTIONS["sdpa"] if original == "sdpa" else \
                sys.modules[type(module).__module__].eager_attention_forward
            return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        out = view.layer(module.layer_idx).attend(query, key, value, scaling, kwargs.get("softcap"),
                                                  sdpa=original == "sdpa")
        return out.transpose(1, 2), None
    return attention


for _name in ATTENTION_FUNCTIONS:
    ALL_ATTENTION_FUNCTIONS.register(f"{PAGED}{_name}", _paged_attention(_name))
    ALL_MASK_ATTENTION_FUNCTIONS.register(f"{PAGED}{_name}", ALL_MASK_ATTENTION_FUNCTIONS[_name])


class _Handed(Exception):
    """Stops a base forward where it calls its language model (encode)."""


def _text_config_key(config) -> str | None:
    """The name under which a composite config keeps its language model's (LLaVA's, Qwen2-VL's text_config)."""
    text = config.get_text_config()
    return next((k for k in getattr(config, "sub_configs", {}) if getattr(config, k, None) is text), None) \
        if text is not config else None


class TransformersLM(nn.Module):
    """`hf` (a transformers causal LM, or a vision-language model, eval mode) as bunsan serve runs it. `hf_model`
    is the model itself (tensor parallelism splits it where the plan names its modules)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        if cache_keyword(hf) != "cache":
            import transformers
            raise ValueError(f"serving a {hf.config.model_type} model needs transformers >= 5 (its forward's "
                             f"`cache` and per-kind masks); this is {transformers.__version__}: upgrade it")
        self.hf_model = hf.eval()
        text = hf.config.get_text_config()
        self.config = ServedShape.of(text)
        self.kinds, self.window = attention_layout(text)
        # a vision-language model's base (its encoders, projector and language model), else None
        self.composite = hf_composite_base(hf)
        self.image_token_id = (getattr(hf.config, "image_token_id", None) or
                               getattr(hf.config, "image_token_index", None)) if self.composite else None
        # its attention layers hand their work to the paged cache (_paged_attention), in its own kernel's form;
        # a vision-language model's language model only (its encoders keep their kernels)
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(hf.forward).parameters
        paged = f"{PAGED}{attention_function(text)}"
        key = _text_config_key(hf.config)
        hf.set_attn_implementation({key: paged} if key else paged)

    @property
    def architecture(self) -> str:
        return type(self.hf_model).__name__

    @property
    def input_device(self) -> torch.device:
        return input_device(self.hf_model)

    def cache_devices(self) -> list[torch.device]:
        """Where each layer's keys and values sit: beside its attention (a device map spreads them)."""
        devices = {}
        for module in self.hf_model.modules():
            idx = getattr(module, "layer_idx", None)
            if isinstance(idx, int) and idx not in devices:
                p = next(module.parameters(), None)
                if p is not None:
                    hook = getattr(module, "_hf_hook", None)
                    devices[idx] = getattr(hook, "execution_device", None) or \
                        (torch.device("cpu") if p.is_meta else p.device)
        return [torch.device(devices.get(i, self.input_device)) for i in range(self.config.num_hidden_layers)]

    def encode(self, ids: list[int], inputs: dict):
        """A prompt's images as its language model reads them (media.Encoded): the model's base forward runs
        its encoders and projector over `inputs` (the processor's pixel_values, image_grid_thw, ...) and is
        stopped as it calls its language model, whose inputs are kept: the prompt positions whose embedding is
        not the token's own, those embeddings, and 3D positions when the model computes some."""
        from bunsan.serve.media import Encoded
        if self.composite is None:
            raise ValueError(f"{self.config.model_type} takes no images")
        base = self.hf_model.get_submodule(self.composite)
        language = self.hf_model.get_submodule(hf_decoder_prefix(self.hf_model))
        handed = {}

        def stop(_module, _args, kwargs):
            handed.update(kwargs)
            raise _Handed
        device = self.input_device
        tokens = torch.tensor([ids], device=device)
        handle = language.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            with torch.no_grad():
                base(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                     **{k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()})
        except _Handed:
            pass
        finally:
            handle.remove()
        if "inputs_embeds" not in handed:
            raise ValueError(f"{self.config.model_type}'s base forward never called its language model")
        with torch.no_grad():
            embeds = handed["inputs_embeds"][0]
            rows = torch.nonzero((embeds != self.hf_model.get_input_embeddings()(tokens)[0]).any(-1)).flatten()
        positions, delta = handed.get("position_ids"), 0
        if positions is not None and positions.ndim == 3:     # [3 (or text + 3), 1, prompt]
            positions = positions[-3:, 0].cpu()
            delta = int(positions.max()) + 1 - len(ids)
        else:
            positions = None
        return Encoded(rows.cpu(), embeds[rows].cpu(), positions, delta)

    def forward(self, input_ids: torch.Tensor, kv_cache) -> torch.Tensor:
        view = kv_cache
        view.windows = [self.window if kind == "sliding_attention" else None for kind in self.kinds]
        device = input_ids.device
        # the paged attention masks each row itself; a 4D mask is used as given, so none is built per forward
        placeholder = torch.zeros(1, 1, 1, 1, device=device)
        mask = {kind: placeholder for kind in ATTENTION_KINDS} \
            if getattr(self.hf_model.config.get_text_config(), "layer_types", None) else placeholder
        media = view.media                         # (token indices, their embeddings, 3D positions or None)
        inputs = {"input_ids": input_ids, "position_ids": view.at.to(device)}
        if view.keep is not None and self.takes_logits_to_keep:    # the head at those tokens only
            inputs["logits_to_keep"] = view.keep.to(device)
        if media is not None:
            index, embeddings, positions = media
            with torch.no_grad():
                embeds = self.hf_model.get_input_embeddings()(input_ids)
                embeds[0, index.to(device)] = embeddings.to(embeds.device, embeds.dtype)
            inputs = {**inputs, "inputs_embeds": embeds, "input_ids": None, "position_ids":
                      view.at.to(device) if positions is None else positions[:, None].to(device)}
        token = _serving.set(view)
        try:
            out = self.hf_model(**inputs, attention_mask=mask, cache=_RowsCache(view), use_cache=True)
        finally:
            _serving.reset(token)
        view.advance(input_ids.shape[1])
        if view.keep is not None and not self.takes_logits_to_keep:
            return out.logits[:, view.keep.to(out.logits.device)]
        return out.logits
