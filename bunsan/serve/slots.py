"""The KV cache of `bunsan serve`: `slots` independent rows, [slots, kv_heads, max_len, head_dim] per layer,
each with its own length. A forward over some rows writes each row's new keys and values at its own
positions (rotary position per row, an attention mask that hides other rows' lengths and padding).
"""

from __future__ import annotations

import torch

from bunsan.memory.measure import host_available_bytes
from bunsan.models.generate import KVCache, layer_devices


class _SlotLayer:
    def __init__(self, view: "_SlotView", i: int):
        self.view, self.i = view, i
        self.attn_mask = view.on("mask", view.cache.k[i].device)   # beside the layer (a device map spreads them)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new keys and values at its own positions; all its keys so far, padded to the
        longest row (the mask hides the padding)."""
        c, w = self.view.cache, self.view
        ck, cv = c.k[self.i], c.v[self.i]
        rows, at = w.on("rows", ck.device), w.on("at", ck.device)
        ck[rows[:, None], :, at] = k.transpose(1, 2)
        cv[rows[:, None], :, at] = v.transpose(1, 2)
        return ck[rows, :, :w.keys], cv[rows, :, :w.keys]


class _SlotView:
    """The cache as the model sees it for one forward over `rows`, each adding `new` tokens."""

    def __init__(self, cache: "SlotCache", rows: list[int], new: int):
        self.cache, self.rows = cache, torch.tensor(rows, dtype=torch.long)
        self.positions = cache.lengths[self.rows]                      # where each row's new tokens start
        self.at = self.positions[:, None] + torch.arange(new)          # [n, new] positions written
        self.keys = int(self.at.max()) + 1
        if self.keys > cache.max_len:
            raise ValueError(f"slot cache full: position {self.keys} > max_len {cache.max_len}")
        visible = torch.arange(self.keys)[None, None, :] <= self.at[:, :, None]   # causal, and no padding
        self.mask = visible[:, None]                                   # [n, 1, new, keys]
        self._on: dict = {}
        self.new = new

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """`rows`, `at` or `mask` (built on the CPU) on `device`: moved once per forward and device, shared by
        the layers there, instead of a host-to-device copy per layer."""
        key = (name, device)
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]

    def layer(self, i: int) -> _SlotLayer:
        return _SlotLayer(self, i)

    def advance(self, n: int) -> None:
        self.cache.lengths[self.rows] += n


class SlotCache:
    def __init__(self, model, slots: int, max_len: int, kv_heads: int | None = None):
        """`model`: bunsan's Llama, or a transformers model behind transformers_model.TransformersLM."""
        self.device = input_device(model)
        # generate's cache, one row per slot (each layer's beside the layer under a device map), in the weights'
        # dtype; the rows' own lengths replace its single position
        devices = model.cache_devices() if hasattr(model, "cache_devices") else layer_devices(model)
        kv = KVCache(model.config, slots, max_len, device=self.device, dtype=next(model.parameters()).dtype,
                     num_kv_heads=kv_heads, layer_devices=devices)
        self.k, self.v = kv.k, kv.v
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """The cache's size in bytes (keys and values of every layer)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Row `dst` takes row `src`'s first `n` positions (a shared prefix), in every layer."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n

    def view(self, rows: list[int], new: int) -> _SlotView:
        return _SlotView(self, rows, new)


def input_device(model) -> torch.device:
    """Where the model starts, so where the token ids go and the positions are cut: beside bunsan's Llama's
    rotary tables (which sit by the embedding, under a device map too), or a transformers model's embedding."""
    return model.rope_cos.device if hasattr(model, "rope_cos") else model.input_device


def slot_bytes(config, max_len: int, kv_heads: int | None, dtype: torch.dtype) -> int:
    """The keys and values one slot of `max_len` tokens holds, over every layer."""
    kv = kv_heads or config.num_key_value_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv * max_len * config.head_dim * itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free where the cache would go: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()
