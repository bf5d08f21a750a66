"""A transformers causal LM (Qwen2/3, Mistral, Gemma 2/3, Phi-3, GPT-2, ...) behind the forward `bunsan serve`'s
batcher calls on bunsan's Llama: `model(ids, kv_cache=view)` -> logits [rows, new, vocab], with every row at its
own positions in the serving KV cache (paged.py).

transformers' own forward runs unchanged; three of its inputs carry the batch's layout:
- `cache`: an object with transformers' `update(keys, values, layer_idx)` that writes each row's new keys and
  values into its blocks of the serving cache and hands back all of the row's keys so far;
- `position_ids`: each row's positions (rotary or learned), so a row's 10th token is at 10 whatever the others;
- `attention_mask`: an additive 4D mask per attention kind the config's layer_types name (full, sliding window),
  which hides other rows' lengths and the padding. transformers uses a 4D mask as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.models.hf import cache_keyword, input_device

ATTENTION_KINDS = ("full_attention", "sliding_attention")
ATTENTION_FUNCTIONS = ("sdpa", "eager")      # those that take an additive 4D mask as given


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
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in ATTENTION_FUNCTIONS:
        raise ValueError(f"{config.model_type} uses attn_implementation {implementation!r}; bunsan serve passes "
                         f"a 4D mask, which {' and '.join(ATTENTION_FUNCTIONS)} take: load it with one of those")
    return kinds, window


class _RowsCache:
    """transformers' cache interface over one forward's view of the serving cache (paged.py's PagedView)."""

    is_compileable = False

    def __init__(self, view):
        self.view = view

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        # the cache lives beside its layer; a layer placed elsewhere (accelerate's hooks) gets its keys back there
        layer = self.view.layer(layer_idx)
        k, v = layer.update(keys, values)
        return k.to(keys.device), v.to(values.device)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.view.positions.min())


class TransformersLM(nn.Module):
    """`hf` (a transformers causal LM, eval mode) as bunsan serve runs it. `hf_model` is the model itself (tensor
    parallelism splits it where the plan names its modules)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        if cache_keyword(hf) != "cache":
            import transformers
            raise ValueError(f"serving a {hf.config.model_type} model needs transformers >= 5 (its forward's "
                             f"`cache` and per-kind masks); this is {transformers.__version__}: upgrade it")
        self.hf_model = hf.eval()
        self.config = ServedShape.of(hf.config)
        self.kinds, self.window = attention_layout(hf.config)

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

    def _masks(self, view, dtype: torch.dtype, device: torch.device):
        """The additive mask per attention kind: 0 where a row's query sees a key, the dtype's lowest elsewhere
        (never -inf: a padding query that sees nothing gets zeros, not NaN)."""
        keys = torch.arange(view.keys)[None, None, :]
        at = view.at[:, :, None]
        out = {}
        for kind in set(self.kinds):
            visible = keys <= at
            if kind == "sliding_attention":
                visible &= keys > at - self.window          # transformers' sliding_window_overlay
            blocked = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
            out[kind] = blocked[:, None].to(device)
        return out

    def forward(self, input_ids: torch.Tensor, kv_cache) -> torch.Tensor:
        view = kv_cache
        dtype = self.hf_model.get_input_embeddings().weight.dtype
        device = input_ids.device
        masks = self._masks(view, dtype, device)
        # a model with layer_types reads the mask of each layer's kind from a dict; the others take one mask
        mask = masks if getattr(self.hf_model.config, "layer_types", None) else masks[self.kinds[0]]
        out = self.hf_model(input_ids=input_ids, position_ids=view.at.to(device), attention_mask=mask,
                            cache=_RowsCache(view), use_cache=True)
        view.advance(input_ids.shape[1])
        return out.logits
