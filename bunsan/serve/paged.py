"""The paged KV cache of `bunsan serve` (vLLM's PagedAttention layout): per layer a pool of blocks,
[num_blocks, block_size, kv_heads, head_dim] for keys and the same for values, and per sequence a block table
(blocks.py hands them out). A sequence holds only the blocks its tokens fill, so the cache holds as many
sequences as their real lengths allow, not `budget / context`.

One forward runs rows (sequences) that each add up to `new` tokens at their own positions: a row's new keys
and values are written into its blocks at those positions, and attention reads the row's blocks back in table
order, with a mask that hides positions past each query (and other rows' lengths). Rows shorter than `new`
(a batched prefill's padding) write their padding into block 0, which no sequence owns.
"""

from __future__ import annotations

import torch

from bunsan.memory.measure import host_available_bytes
from bunsan.models.generate import layer_devices


class _PagedLayer:
    def __init__(self, view: "PagedView", i: int):
        self.view, self.i = view, i
        self.attn_mask = view.on("mask", view.cache.k[i].device)   # beside the layer (a device map spreads them)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new keys and values [n, kv, new, hd] into its blocks; all its keys so far
        [n, kv, keys, hd], its blocks in table order (the mask hides what is past a query)."""
        w, pool_k, pool_v = self.view, self.view.cache.k[self.i], self.view.cache.v[self.i]
        blocks, bs, kv, hd = pool_k.shape
        slots = w.on("slots", pool_k.device)           # a token's place: block * block_size + offset
        pool_k.view(blocks * bs, kv, hd)[slots] = k.transpose(1, 2).reshape(-1, kv, hd).to(pool_k.dtype)
        pool_v.view(blocks * bs, kv, hd)[slots] = v.transpose(1, 2).reshape(-1, kv, hd).to(pool_v.dtype)
        table = w.on("tables", pool_k.device)
        n, nb = table.shape

        def read(pool, into):   # [n, nb, bs, kv, hd] -> [n, kv, keys, hd], cut at the longest row's keys
            # index_select copies whole blocks (advanced indexing, pool[table], walks them element by element)
            rows = torch.index_select(pool.view(blocks, -1), 0, table.reshape(-1), out=into)
            return rows.view(n, nb * bs, kv, hd)[:, :w.keys].transpose(1, 2)
        into_k, into_v = w.cache.gather_buffers(pool_k, n * nb)
        return read(pool_k, into_k), read(pool_v, into_v)


class PagedView:
    """The cache as the model sees it for one forward: row j holds the blocks tables[j] (padded with block 0),
    has lengths[j] tokens cached before it, and adds counts[j] of the forward's `new` tokens."""

    def __init__(self, cache: "PagedCache", tables: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor,
                 new: int):
        self.cache, self.new = cache, new
        self.positions = lengths                                       # where each row's new tokens start
        self.at = lengths[:, None] + torch.arange(new)                 # [n, new] positions written
        self.keys = int((lengths + counts).max())                      # the longest row's keys (not padding's)
        bs = cache.block_size
        if self.keys > tables.shape[1] * bs:
            raise ValueError(f"a row's position {self.keys - 1} is past its {tables.shape[1]} blocks of {bs} tokens")
        real = torch.arange(new)[None, :] < counts[:, None]
        block = tables.gather(1, (self.at // bs).clamp(max=tables.shape[1] - 1))
        self.slots = torch.where(real, block * bs + self.at % bs, self.at % bs).reshape(-1)   # padding: block 0
        self.tables = tables[:, :(self.keys + bs - 1) // bs]
        keys = torch.arange(self.keys)
        self.mask = (keys[None, None, :] <= self.at[:, :, None])[:, None]    # [n, 1, new, keys]: causal
        self.counts = counts
        self._on: dict = {}

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """`slots`, `tables` or `mask` (built on the CPU) on `device`: moved once per forward and device."""
        key = (name, device)
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]

    def layer(self, i: int) -> _PagedLayer:
        return _PagedLayer(self, i)

    def advance(self, n: int) -> None:
        """The model ran (its forward calls this); the block tables' owner keeps the lengths (batcher.py)."""


class PagedCache:
    """The pools, every layer's beside the layer (a device map spreads them), in the weights' dtype."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_heads: int | None = None):
        """`model`: bunsan's Llama, or a transformers model behind transformers_model.TransformersLM."""
        cfg = model.config
        self.device = input_device(model)
        devices = model.cache_devices() if hasattr(model, "cache_devices") else layer_devices(model)
        kv = kv_heads or cfg.num_key_value_heads
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, kv, cfg.head_dim)
        self.k = [torch.zeros(shape, device=d, dtype=dtype) for d in devices]
        self.v = [torch.zeros(shape, device=d, dtype=dtype) for d in devices]
        self.num_blocks, self.block_size = num_blocks, block_size
        self._gathered: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def gather_buffers(self, pool: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where one layer's attention reads its rows' keys and values, `blocks` blocks each: two buffers per
        device, grown to the largest read so far and reused by every layer and forward (a layer is done with
        them before the next one reads). A fresh copy per layer would cost the host a page fault per 4 KiB
        touched: the allocator hands big blocks back to the OS and maps them anew."""
        have = self._gathered.get(pool.device)
        if have is None or have[0].shape[0] < blocks:
            shape = (blocks, pool[0].numel())
            have = tuple(torch.empty(shape, device=pool.device, dtype=pool.dtype) for _ in range(2))
            self._gathered[pool.device] = have
        return have[0][:blocks], have[1][:blocks]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def view(self, tables: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor, new: int) -> PagedView:
        return PagedView(self, tables, lengths, counts, new)


def input_device(model) -> torch.device:
    """Where the model starts, so where the token ids go and the positions are cut: beside bunsan's Llama's
    rotary tables (which sit by the embedding, under a device map too), or a transformers model's embedding."""
    return model.rope_cos.device if hasattr(model, "rope_cos") else model.input_device


def block_bytes(config, block_size: int, kv_heads: int | None, dtype: torch.dtype) -> int:
    """The keys and values one block of `block_size` tokens holds, over every layer."""
    kv = kv_heads or config.num_key_value_heads
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv * block_size * config.head_dim * itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free where the cache would go: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()
