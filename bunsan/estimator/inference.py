"""Memory of generation with bunsan's Llama (`bunsan.models.generate`), block by block, from the config alone.

For a batch of b sequences, a prompt of p tokens and a KV cache of T = p + new tokens, hidden h, intermediate i,
a query heads of head_dim hd and k key/value heads, vocabulary V, model dtype of d bytes:

  weights     embedding V·h·d; each block (2h² + 2h·k·hd + 3h·i + 2h)·d; final norm h·d; head V·h·d, or
              nothing when tied (it is the embedding's tensor). The same numbers as inference.model_blocks.
  KV cache    KVCache preallocates keys and values [b, k, T, hd] per layer, beside the layer, at full length:
              2·b·k·T·hd·d per layer from the start; it never grows or copies.
  one step    a forward pass runs one block at a time, so a device holds at most one block's working set
              (below) plus the residual stream. Prefill (n = b·p tokens) is the larger step for the MLP;
              the last decode step (n = b, keys over all T) can be the larger one for attention under GQA.
  logits      the head's device holds the prompt's logits b·p·V·d until the next step's replace them, beside
              the final norm's input and output or the next step's working set: its peak is the larger of
              that and one step.

Activation terms were read off the model's code and checked against the live tensors of a real forward
(tests/test_inference_memory.py); fused attention (torch's SDPA: flash on CPU, flash or memory-efficient on
CUDA) never materialises the b·a·p·T scores, so they are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bunsan.models.llama import Attention, LlamaConfig


@dataclass(frozen=True)
class InferenceMemory:
    weights: dict           # block name -> bytes, in model order (embed_tokens, layers.i, norm, lm_head)
    kv_cache: dict          # "layers.i" -> bytes of its keys and values
    step: int               # peak working set of one forward step on a device that runs blocks
    logits: int             # extra on the head's device, beyond `step`
    rope: int               # the rotary tables, fp32, beside the embedding (where the model starts)
    batch: int
    prompt_len: int
    max_seq: int

    def block_bytes(self, name: str) -> int:
        """What a block needs where it lives: its weights and, for a transformer block, its KV cache."""
        return self.weights[name] + self.kv_cache.get(name, 0)

    def device_bytes(self, names, computes: bool = True) -> dict:
        """Predicted bytes on a device holding `names` (weights, kv_cache, activations, total).
        `computes`: the device runs blocks (False for "disk", whose blocks run on the CPU)."""
        names = list(names)
        out = {"weights": sum(self.weights[n] for n in names),
               "kv_cache": sum(self.kv_cache.get(n, 0) for n in names),
               "activations": (self.step + (self.logits if "lm_head" in names else 0)) if computes and names else 0}
        out["total"] = sum(out.values())
        return out


def _dtype_bytes(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else int(dtype)


def weight_bytes(cfg: LlamaConfig, d: int) -> dict:
    h, i, kv_dim = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim
    layer = (2 * h * cfg.attention_dim + 2 * h * kv_dim + 3 * h * i + 2 * h) * d  # q, o; k, v; gate, up, down; norms
    out = {"embed_tokens": cfg.vocab_size * h * d}
    out.update({f"layers.{j}": layer for j in range(cfg.num_hidden_layers)})
    out["norm"] = h * d
    out["lm_head"] = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h * d
    return out


def kv_cache_bytes(cfg: LlamaConfig, batch: int, max_seq: int, d: int) -> int:
    """One layer's preallocated keys and values (bunsan.models.generate.KVCache)."""
    return 2 * batch * cfg.num_key_value_heads * max_seq * cfg.head_dim * d


def layer_step_bytes(cfg: LlamaConfig, batch: int, tokens: int, keys: int, d: int) -> int:
    """Peak bytes alive while one transformer block runs `tokens` new tokens per sequence over `keys` cached
    positions (its weights and KV cache excluded)."""
    h, i, n, q = cfg.hidden_size, cfg.intermediate_size, batch * tokens, cfg.attention_dim
    # K/V are repeated to every query head only where SDPA's fused kernels do not take grouped heads (on a GPU
    # in fp32; models/llama.Attention.native_gqa)
    repeated = cfg.num_key_value_heads < cfg.num_attention_heads and not Attention.native_gqa(
        "cuda", torch.float32 if d >= 4 else torch.bfloat16, cfg.head_dim, masked=False)
    # attention, at o_proj: the block's input, the normed input, q, the attention output, its [b, s, heads x
    # head_dim] copy and o_proj's result; where repeated also k and v repeated to every query head over all
    # cached positions
    attention = 3 * d * n * (h + q) + (2 * d * batch * keys * q if repeated else 0)
    # MLP, at gate * up: the block's input and the residual after attention, the normed input, silu(gate), up and
    # their product
    mlp = 3 * d * n * h + 3 * d * n * i
    # RMSNorm computes in fp32: the input, its fp32 square and the fp32 normalised copy (plus casts in 16-bit)
    norm = d * n * h + 8 * n * h + (2 * (4 + d) * n * h if d < 4 else 4 * n * h)
    return max(attention, mlp, norm)


def inference_memory(cfg: LlamaConfig, batch: int = 1, max_seq: int | None = None, dtype=torch.float32,
                     prompt_len: int | None = None) -> InferenceMemory:
    """Bytes of generating up to `max_seq` tokens per sequence (prompt included) for `batch` sequences whose
    prompts have `prompt_len` tokens (default: max_seq - 1, the largest prefill)."""
    max_seq = cfg.max_position_embeddings if max_seq is None else max_seq
    if not 1 <= max_seq <= cfg.max_position_embeddings:
        raise ValueError(f"max_seq {max_seq} must be in 1..max_position_embeddings "
                         f"{cfg.max_position_embeddings} (prompt plus new tokens); shorten the prompt or "
                         "generate fewer tokens")
    prompt_len = max(max_seq - 1, 1) if prompt_len is None else prompt_len
    if not 1 <= prompt_len <= max_seq:
        raise ValueError(f"prompt_len {prompt_len} must be in 1..max_seq {max_seq}; the cache holds the prompt")
    if batch < 1:
        raise ValueError(f"batch {batch} must be >= 1")
    d = _dtype_bytes(dtype)
    kv = kv_cache_bytes(cfg, batch, max_seq, d)
    decode = layer_step_bytes(cfg, batch, 1, max_seq, d)                       # the last decode step
    step = max(layer_step_bytes(cfg, batch, prompt_len, prompt_len, d), decode)  # or prefill
    # the head's device: the prompt's logits, then the final norm's input and output beside them, or the next
    # step (and its logits) while generate still holds them
    prompt_logits = d * batch * prompt_len * cfg.vocab_size
    head = prompt_logits + max(2 * d * batch * prompt_len * cfg.hidden_size, decode + d * batch * cfg.vocab_size)
    logits = max(0, head - step)
    return InferenceMemory(weights=weight_bytes(cfg, d),
                           kv_cache={f"layers.{j}": kv for j in range(cfg.num_hidden_layers)},
                           step=step, logits=logits, rope=2 * 4 * cfg.max_position_embeddings * cfg.head_dim,
                           batch=batch, prompt_len=prompt_len, max_seq=max_seq)
