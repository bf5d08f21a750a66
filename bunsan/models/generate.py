"""KV cache and autoregressive generation for the reference Llama."""
from __future__ import annotations

import torch

from bunsan.models.hf import cache_keyword
from bunsan.models.llama import Llama, LlamaConfig


def layer_devices(model: Llama) -> list[torch.device]:
    """Where each block computes, so its KV cache sits beside it: its weights' device, or the CPU for a block
    whose weights wait on disk between uses (bunsan.inference.load keeps those on the meta device)."""
    out = []
    for block in model.layers:
        p = next(block.parameters())
        out.append(torch.device("cpu") if p.is_meta else p.device)
    return out


class _LayerKV:
    """One layer's view of the cache: writes new k/v at the current position."""

    def __init__(self, cache: "KVCache", i: int):
        self.cache, self.i = cache, i

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        start, end = c.pos, c.pos + k.shape[2]
        if end > c.max_len:
            raise ValueError(f"KVCache full: position {end} > max_len {c.max_len}; allocate a longer cache")
        c.k[self.i][:, :, start:end] = k
        c.v[self.i][:, :, start:end] = v
        return c.k[self.i][:, :, :end], c.v[self.i][:, :, :end]


class KVCache:
    """Preallocated per-layer keys/values [b, kv_heads, max_len, head_dim] plus a position.

    Layers write at ``pos``; the model calls ``advance(s)`` after all layers ran.
    Local head counts are taken from ``num_kv_heads`` so a TP rank can pass its shard.
    """

    def __init__(self, config: LlamaConfig, batch_size: int, max_len: int,
                 device=None, dtype=torch.float32, num_kv_heads: int | None = None, layer_devices=None):
        kv = num_kv_heads or config.num_key_value_heads
        shape = (batch_size, kv, max_len, config.head_dim)
        # a model spread over devices (bunsan.inference) keeps each layer's cache beside the layer
        devices = layer_devices or [device] * config.num_hidden_layers
        self.k = [torch.zeros(shape, device=d, dtype=dtype) for d in devices]
        self.v = [torch.zeros(shape, device=d, dtype=dtype) for d in devices]
        self.max_len = max_len
        self.pos = 0

    def layer(self, i: int) -> _LayerKV:
        return _LayerKV(self, i)

    def advance(self, n: int) -> None:
        self.pos += n

    def reset(self) -> None:
        self.pos = 0


def sampling_device(logits_device: torch.device, generator: torch.Generator | None) -> torch.device:
    """Where a token is drawn: on the generator's device when there is one (torch.multinomial refuses a
    generator of another device, and drawing on the generator's device gives a seed the same tokens whichever
    device ran the model), else where the logits are (torch's default generator of that device)."""
    return generator.device if generator is not None else logits_device


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator,
                top_p: float = 1.0) -> torch.Tensor:
    """logits [b, vocab] -> token ids [b]: greedy at temperature 0; else temperature, top-k, then top-p
    (nucleus: the smallest set of tokens whose probabilities reach top_p), in fp32, drawn on
    `sampling_device` (the token ids come back there)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.to(sampling_device(logits.device, generator)).float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Llama, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_token_id: int | list[int] | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             kv_heads: int | None = None) -> torch.Tensor:
    """Extend ``input_ids`` [b, s] by up to ``max_new_tokens``; returns [b, s + new].

    Greedy when temperature == 0. Prefills the prompt into a KV cache, then feeds one token at a time.
    Sequences that emitted ``eos_token_id`` (one id, or a list: any of them ends a sequence, as
    generation_config.json's) keep emitting it; generation stops early once all have. ``kv_heads``: this
    rank's key/value heads when the attention is split over a tensor-parallel group (the cache is sharded by
    heads). A transformers model runs with its own cache (past_key_values), the tokens chosen the same way.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be a positive int or None, got {top_k}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if not isinstance(model, Llama):          # a transformers model: its own cache, the same token choice
        return _generate_hf(model, input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator)
    cfg = model.config
    b, s = input_ids.shape
    total = s + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(f"prompt {s} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    cache = None
    if use_cache:
        p = next(model.parameters())
        # the rope tables sit where the model starts (a block offloaded to disk has meta parameters); the
        # cache takes the weights' dtype, as the keys and values the layers write into it have
        device = model.rope_cos.device if hasattr(model, "rope_cos") else p.device
        cache = KVCache(cfg, b, total, device=device, dtype=p.dtype, num_kv_heads=kv_heads,
                        layer_devices=layer_devices(model))
    return _decode(model, input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator,
                   lambda step_input, out: model(step_input if use_cache else out, kv_cache=cache)[:, -1])


def _generate_hf(model, input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator):
    """generate() for a transformers causal LM: its forward and key/value cache (past_key_values)."""
    past = None
    keyword = cache_keyword(model) or "past_key_values"

    def step(step_input, out):
        nonlocal past
        result = model(input_ids=step_input, use_cache=True, **{keyword: past})
        past = getattr(result, keyword)
        return result.logits[:, -1]

    return _decode(model, input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator, step)


def _decode(model, input_ids, max_new_tokens, temperature, top_k, eos_token_id, generator, step):
    """The token loop: `step(new tokens, all tokens)` gives the last position's logits; the next token is chosen
    by next_token, and a sequence ends at any of the end tokens (then keeps emitting the first)."""
    stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    stop_ids = torch.tensor(stops, dtype=torch.long, device=input_ids.device)
    was_training = model.training
    model.eval()
    out, step_input = input_ids, input_ids
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    try:
        for _ in range(max_new_tokens):
            # the head (or the generator) may sit on another device than the tokens so far
            nxt = next_token(step(step_input, out), temperature, top_k, generator).to(out.device)
            if stops:
                nxt = torch.where(done, torch.full_like(nxt, stops[0]), nxt)
                done |= torch.isin(nxt, stop_ids)
            out = torch.cat([out, nxt[:, None]], dim=1)
            step_input = nxt[:, None]
            if stops and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return out
