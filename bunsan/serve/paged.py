"""The paged KV cache of `bunsan serve` (vLLM's PagedAttention layout): per layer a pool of blocks,
[num_blocks, block_size, kv_heads, head_dim] for keys and the same for values, and per sequence a block table
(blocks.py hands them out). A sequence holds only the blocks its tokens fill, so the cache holds as many
sequences as their real lengths allow, not `budget / context`.

One forward runs every row's new tokens flattened into one row of tokens ([1, tokens], no padding): a
decoding sequence adds one, a prompt being prefilled a chunk. Each token's keys and values are written into
its sequence's block at its position; attention then reads each sequence's blocks back in table order:
- the decoding rows together, as a batch of one query each over their keys (a key mask hides what is past a
  row's length and, on sliding-window layers, before its window); on the CPU a large batch reads its blocks
  in place through the block tables (paged_decode.py), a small one copies them out for PyTorch's attention;
- each prefilling row on its own: its chunk's queries over its keys, causal.
Leading blocks every row shares (a system prompt reused from the prefix cache) are read once for all of them
(cascade attention, FlashInfer's): every query over those blocks, then each row over its own blocks, the two
softmaxes joined by their log-sum-exps; the decoding rows' when they share them, every row's (the prompt
chunks too) when all do.
The model hands its attention to the cache (`layer(i).attend`): bunsan's Llama directly, a transformers model
through the attention function transformers_model.py registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bunsan.memory.measure import host_available_bytes
from bunsan.models.generate import layer_devices
from bunsan.serve import paged_decode


class _PagedLayer:
    def __init__(self, view: "PagedView", i: int):
        self.view, self.i = view, i
        self.window = view.windows[i] if view.windows else None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put the forward's new keys and values [1, kv, tokens, hd] at their tokens' slots."""
        pool_k, pool_v = self.view.cache.k[self.i], self.view.cache.v[self.i]
        blocks, bs, kv, hd = pool_k.shape
        slots = self.view.on("slots", pool_k.device)       # a token's place: block * block_size + offset
        pool_k.view(blocks * bs, kv, hd)[slots] = k[0].transpose(0, 1).to(pool_k.device, pool_k.dtype)
        pool_v.view(blocks * bs, kv, hd)[slots] = v[0].transpose(0, 1).to(pool_v.device, pool_v.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               softcap: float | None = None, sdpa: bool = True) -> torch.Tensor:
        """Write the new keys and values, then every token's attention over its sequence's keys so far:
        q [1, heads, tokens, hd] -> [1, heads, tokens, hd]. `sdpa`: PyTorch's fused kernel; else the eager form
        (scores, `softcap`, fp32 softmax) some transformers models run."""
        self.write(k, v)
        w, pool_k, pool_v = self.view, self.view.cache.k[self.i], self.view.cache.v[self.i]
        device, back = pool_k.device, q.device
        q = q.to(device)
        out = torch.empty_like(q)
        fused = softcap is None and device.type == "cpu" and _CPU_FLASH is not None and self.window is None
        if w.joint and fused:                   # every row starts with the shared blocks: one cascade for all
            heads, tokens, hd = q.shape[1:]
            kv = pool_k.shape[2]
            grouped = q[0].float().view(kv, heads // kv, tokens, hd).transpose(1, 2)    # [kv, tokens, rep, hd]
            got = self._cascade_fused(grouped, pool_k, pool_v, hd ** -0.5 if scale is None else scale,
                                      w.on("decoding", device), w.prefills)
            out[0] = got.transpose(1, 2).reshape(heads, tokens, hd).to(out.dtype)
            return out.to(back)
        if w.decoding.numel():
            d = w.on("decoding", device)
            rows = q[0, :, d].transpose(0, 1)[:, :, None]         # [rows, heads, 1, hd]
            if w.shared and self.window is None:
                got = self._cascade(rows, pool_k, pool_v, scale, softcap, fused)
            else:
                got, (n, heads, _, hd) = None, rows.shape
                grouped = rows.view(n, pool_k.shape[2], -1, hd)         # query head h reads kv head h // rep
                # the blocks read where they lie (a large batch on the CPU), or copied out
                if sdpa and softcap is None and paged_decode.in_place(grouped, pool_k, w.decode_tables):
                    got = paged_decode.COMPILED(grouped.float(), pool_k, pool_v, w.on(w.decode_tables, device),
                                                w.key_bias(self.window, device), hd ** -0.5 if scale is None else scale)
                    got = None if got is None else got[0].view(n, heads, 1, hd).to(rows.dtype)
                if got is None:
                    keys, values = self._read(w.decode_tables, pool_k, pool_v)
                    got = _attention(rows, keys, values, w.key_mask(self.window, device), scale, softcap, sdpa)
            out[0, :, d] = got[:, :, 0].transpose(0, 1)
        for table, start, count, length in w.prefills:             # few per forward, each its own chunk
            keys, values = self._read(table, pool_k, pool_v)
            chunk = q[:, :, start:start + count]
            mask = w.causal_mask(length, count, self.window, device)
            out[:, :, start:start + count] = _attention(chunk, keys, values, mask, scale, softcap, sdpa)
        return out.to(back)

    def _cascade(self, rows: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, scale, softcap, fused: bool):
        """The decoding rows' attention when they all start with the same `shared` blocks (a system prompt):
        every row's query over those blocks read once, then each row's own blocks, the two softmaxes joined by
        their log-sum-exps (FlashInfer's cascade attention). rows [n, heads, 1, hd] -> the same."""
        w = self.view
        n, heads, _, hd = rows.shape
        kv = pool_k.shape[2]
        q = rows.view(n, kv, heads // kv, hd).float()            # query head h reads kv head h // (heads / kv)
        scale = hd ** -0.5 if scale is None else scale
        if fused:
            got = self._cascade_fused(q.transpose(0, 1), pool_k, pool_v, scale, slice(None), [])
            return got.transpose(0, 1).reshape(n, heads, 1, hd).to(rows.dtype)
        shared = w.on("shared_blocks", pool_k.device)
        pk, pv = (pool[shared].reshape(1, -1, kv, hd).permute(2, 0, 1, 3).float() for pool in (pool_k, pool_v))
        # [kv, n * rep, hd] @ [kv, hd, keys]: one matmul per kv head over every row's queries
        first = torch.matmul(q.permute(1, 0, 2, 3).reshape(kv, -1, hd), pk[:, 0].transpose(1, 2)) * scale
        keys, values = self._read(w.own_tables, pool_k, pool_v)   # [n, kv, own keys, hd]
        second = torch.matmul(q, keys.transpose(-1, -2).float()) * scale      # [n, kv, rep, own keys]
        if softcap is not None:
            first, second = (torch.tanh(x / softcap) * softcap for x in (first, second))
        second = second.masked_fill(~w.on("own_mask", pool_k.device), float("-inf"))
        rep = heads // kv
        first = first.view(kv, n, rep, -1)                                   # [kv, n, rep, shared keys]
        total = torch.stack([first.logsumexp(-1).transpose(0, 1), second.logsumexp(-1)]).logsumexp(0)
        # each part's softmax over all of the row's keys, times its values: the shared one per kv head again
        mine = torch.exp(first - total.transpose(0, 1)[..., None]).reshape(kv, n * rep, -1)
        out = torch.matmul(mine, pv[:, 0]).view(kv, n, rep, hd).transpose(0, 1) + \
            torch.matmul(torch.exp(second - total[..., None]), values.float())
        return out.reshape(n, heads, 1, hd).to(rows.dtype)

    def _cascade_fused(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, scale: float,
                       decoding, prefills: list) -> torch.Tensor:
        """_cascade's two parts in PyTorch's fused CPU attention, which gives each softmax's log-sum-exp and
        reads the gathered keys in place (a matmul over them copies them into its own layout first). q [kv,
        tokens, rep, hd], each kv head's query heads side by side -> the same: the shared blocks as one sequence
        of every token's queries per kv head; then each token's own blocks: the decoding tokens (`decoding`
        indexes them) as multi-query rows of rep heads over their kv head, and each prompt chunk of
        `prefills` (a joint cascade, PagedView.joint) causal over its row's blocks past the shared ones.
        The fused kernel reads the pool in its own dtype (a 16-bit one accumulates in fp32 inside, as
        transformers' sdpa on the same weights does): no converted copy of the keys and values; the parts'
        outputs are joined in fp32."""
        w = self.view
        kv, tokens, rep, hd = q.shape
        low = q.to(pool_k.dtype)                              # the fused kernel's queries: the pool's dtype
        # consecutive blocks (a prefix prefilled into a fresh pool) are read in place; else gathered
        shared = w.shared_run if w.shared_run is not None else w.on("shared_blocks", pool_k.device)
        pk, pv = (pool[shared].reshape(1, -1, kv, hd).transpose(1, 2) for pool in (pool_k, pool_v))
        first, first_lse = _CPU_FLASH(low.reshape(1, kv, tokens * rep, hd), pk, pv, 0.0, False, scale=scale)
        first, first_lse = first.float().view(kv, tokens, rep, hd), first_lse.view(kv, tokens, rep)
        own, own_lse = torch.empty_like(first), torch.empty_like(first_lse)
        if w.decoding.numel():
            rows, read = q[:, decoding].transpose(0, 1), None            # [n, kv, rep, hd]
            if paged_decode.in_place(rows, pool_k, w.own_tables):      # the blocks read where they lie
                read = paged_decode.COMPILED(rows, pool_k, pool_v, w.on(w.own_tables, q.device),
                                             w.own_bias(q.device).view(len(rows), -1), scale)
            if read is None:                                            # or copied out
                keys, values = self._read(w.own_tables, pool_k, pool_v)   # [n, kv, own keys, hd]
                read = _CPU_FLASH(low[:, decoding].transpose(0, 1), keys, values, 0.0, False,
                                  attn_mask=w.own_bias(q.device), scale=scale)
            got, lse = read
            own[:, decoding], own_lse[:, decoding] = got.transpose(0, 1).float(), lse.transpose(0, 1)
        for table, start, count, length in prefills:
            keys, values = self._read(table[:, w.shared:], pool_k, pool_v)
            got, lse = _CPU_FLASH(low[:, start:start + count].reshape(1, kv, count * rep, hd), keys, values, 0.0,
                                  False, attn_mask=w.own_causal(length, count, rep, q.device), scale=scale)
            own[:, start:start + count] = got.view(kv, count, rep, hd)
            own_lse[:, start:start + count] = lse.view(kv, count, rep)
        total = torch.logaddexp(first_lse, own_lse)[..., None]
        return first * torch.exp(first_lse[..., None] - total) + own * torch.exp(own_lse[..., None] - total)

    def _read(self, table: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor):
        """The keys and values of `table`'s rows, [rows, kv, blocks * bs, hd] each, in two reused buffers."""
        blocks, bs, kv, hd = pool_k.shape
        n, nb = table.shape
        index = self.view.on(table, pool_k.device).reshape(-1)
        into_k, into_v = self.view.cache.gather_buffers(pool_k, n * nb)

        def read(pool, into):
            # index_select copies whole blocks (advanced indexing, pool[table], walks them element by element)
            got = torch.index_select(pool.view(blocks, -1), 0, index, out=into)
            return got.view(n, nb * bs, kv, hd).transpose(1, 2)
        return read(pool_k, into_k), read(pool_v, into_v)


# PyTorch's fused CPU attention with its log-sum-exp (what cascade attention joins two softmaxes by); absent from
# a build without it, where the matmul form runs
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attention(q, k, v, mask, scale, softcap, sdpa: bool) -> torch.Tensor:
    """q [n, heads, s, hd] over k, v [n, kv, keys, hd] where `mask` [n or 1, 1, s, keys] is True."""
    rep = q.shape[1] // k.shape[1]
    if sdpa and softcap is None:
        grouped = q.device.type == "cpu"       # the CPU kernel takes grouped heads; repeat elsewhere (llama.py)
        if rep > 1 and not grouped:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=rep > 1 and grouped)
    if sdpa:
        raise ValueError("sdpa attention does not support softcap; load the model with attn_implementation='eager'")
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


class PagedView:
    """The cache as the model sees it for one forward: row j holds the blocks tables[j] (padded with block 0),
    has lengths[j] tokens cached before it, and adds counts[j] tokens, the forward's tokens being every row's in
    row order. `windows`: each layer's sliding window (None: full attention), set by the model."""

    def __init__(self, cache: "PagedCache", tables: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor):
        self.cache, bs = cache, cache.block_size
        self.windows: list[int | None] | None = None
        self.keep: torch.Tensor | None = None    # the tokens whose logits the head computes (None: every one)
        self.media = None                        # image tokens' embeddings (media.overlay), set by the batcher
        row = torch.repeat_interleave(torch.arange(len(counts)), counts)
        starts = torch.cumsum(counts, 0) - counts
        self.tokens = int(counts.sum())
        self.at = (lengths[row] + torch.arange(self.tokens) - starts[row])[None]    # [1, tokens] positions
        ends = lengths + counts
        if int(ends.max()) > tables.shape[1] * bs:
            raise ValueError(f"a row's position {int(ends.max()) - 1} is past its {tables.shape[1]} blocks of {bs} "
                             f"tokens")
        at = self.at[0]
        self.slots = tables[row, at // bs] * bs + at % bs
        decode = counts == 1
        self.decoding = starts[decode]                           # those rows' tokens
        self.decode_at = lengths[decode]                          # and their positions
        width = -(-int(ends[decode].max()) // bs) if self.decoding.numel() else 0
        self.decode_tables = tables[decode, :width]
        self.shared, self.joint = self._shared_blocks(tables, lengths, decode)
        self.shared_run: slice | None = None
        if self.shared:                          # cascade attention (_PagedLayer._cascade): the common blocks
            self.shared_blocks = (tables[0] if self.joint else self.decode_tables[0])[:self.shared]
            first = int(self.shared_blocks[0])
            consecutive = bool((self.shared_blocks == torch.arange(first, first + self.shared)).all())
            self.shared_run = slice(first, first + self.shared) if consecutive else None
            self.own_tables = self.decode_tables[:, self.shared:]
            own = torch.arange(self.own_tables.shape[1] * bs)[None, :] + self.shared * bs
            self.own_mask = (own <= self.decode_at[:, None])[:, None, None]    # [rows, 1, 1, own keys]
        self.prefills = [(tables[j:j + 1, :-(-int(ends[j]) // bs)], int(starts[j]), int(counts[j]), int(lengths[j]))
                         for j in torch.nonzero(~decode).flatten().tolist()]
        self.counts = counts
        self._on: dict = {}

    def _shared_blocks(self, tables: torch.Tensor, lengths: torch.Tensor, decode: torch.Tensor) -> tuple[int, bool]:
        """How many leading blocks rows hold alike (the same blocks, so the same tokens), all of them before
        each of those rows' new tokens, and whether they are every row's (`joint`: the prompt chunks join the
        cascade) or the decoding rows' only; 0 below two rows (nothing to share)."""
        bs = self.cache.block_size

        def common(t: torch.Tensor, at: torch.Tensor) -> int:
            if t.shape[0] < 2:
                return 0
            alike = (t == t[:1]).all(0).long().cumprod(0).sum()
            return int(min(alike, at.min() // bs))
        joint = common(tables, lengths) if not bool(decode.all()) else 0
        return (joint, True) if joint else (common(self.decode_tables, self.decode_at), False)

    def on(self, what, device: torch.device) -> torch.Tensor:
        """A tensor built on the CPU (one of this view's, by name or itself) on `device`, moved once per forward."""
        key = (what if isinstance(what, str) else id(what), device)
        if key not in self._on:
            self._on[key] = (getattr(self, what) if isinstance(what, str) else what).to(device)
        return self._on[key]

    def own_bias(self, device: torch.device) -> torch.Tensor:
        """own_mask as fused attention adds it: 0 where seen, -inf past the row's position."""
        key = ("own bias", device)
        if key not in self._on:
            self._on[key] = torch.zeros(self.own_mask.shape, device=device).masked_fill(
                ~self.on("own_mask", device), float("-inf"))
        return self._on[key]

    def own_causal(self, length: int, count: int, rep: int, device: torch.device) -> torch.Tensor:
        """[1, 1, count * rep, own keys] additive: a chunk's queries (each kv head's rep query heads side by
        side) over its row's keys past the shared blocks, each seeing up to itself."""
        key = ("own causal", length, count, rep, device)
        if key not in self._on:
            bs = self.cache.block_size
            keys = torch.arange(self.shared * bs, -(-(length + count) // bs) * bs)
            seen = (keys[None, :] <= length + torch.arange(count)[:, None]).repeat_interleave(rep, 0)
            self._on[key] = torch.zeros(seen.shape, device=device).masked_fill(~seen, float("-inf"))[None, None]
        return self._on[key]

    def key_mask(self, window: int | None, device: torch.device) -> torch.Tensor:
        """[rows, 1, 1, keys]: the keys each decoding row's one query sees (its own included)."""
        key = ("decode mask", window, device)
        if key not in self._on:
            keys = torch.arange(self.decode_tables.shape[1] * self.cache.block_size)[None, :]
            at = self.decode_at[:, None]
            seen = keys <= at
            if window is not None:
                seen &= keys > at - window                        # transformers' sliding_window_overlay
            self._on[key] = seen[:, None, None].to(device)
        return self._on[key]

    def key_bias(self, window: int | None, device: torch.device) -> torch.Tensor:
        """key_mask as paged_decode adds it, [rows, keys]: 0 where seen, -inf elsewhere."""
        key = ("decode bias", window, device)
        if key not in self._on:
            seen = self.key_mask(window, device)[:, 0, 0]
            self._on[key] = torch.zeros(seen.shape, device=device).masked_fill(~seen, float("-inf"))
        return self._on[key]

    def causal_mask(self, length: int, count: int, window: int | None, device: torch.device) -> torch.Tensor:
        """[1, 1, count, keys]: a chunk of `count` queries after `length` cached tokens, each seeing up to
        itself (the keys past the chunk, in its last block, are hidden too)."""
        key = ("chunk mask", length, count, window, device)
        if key not in self._on:
            keys = torch.arange(-(-(length + count) // self.cache.block_size) * self.cache.block_size)[None, :]
            at = length + torch.arange(count)[:, None]
            seen = keys <= at
            if window is not None:
                seen &= keys > at - window
            self._on[key] = seen[None, None].to(device)
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
        """Where one attention reads its rows' keys and values, `blocks` blocks each: two buffers per device,
        grown to the largest read so far and reused by every layer and forward (an attention is done with them
        before the next one reads). A fresh copy per layer would cost the host a page fault per 4 KiB
        touched: the allocator hands big blocks back to the OS and maps them anew."""
        have = self._gathered.get(pool.device)
        if have is None or have[0].shape[0] < blocks:
            shape = (blocks, pool[0].numel())
            have = tuple(torch.empty(shape, device=pool.device, dtype=pool.dtype) for _ in range(2))
            self._gathered[pool.device] = have
        return have[0][:blocks], have[1][:blocks]

    def warm(self, rep: int) -> bool:
        """Build the decoding kernel before the first request (paged_decode.py; `rep`: query heads per key/value
        head); whether decoding reads the blocks in place."""
        pool = self.k[0]
        return paged_decode.in_place(torch.zeros(1, pool.shape[2], rep, pool.shape[3], device=pool.device), pool)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def view(self, tables: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor) -> PagedView:
        return PagedView(self, tables, lengths, counts)


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
