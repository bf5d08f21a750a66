"""A plain Llama decoder in ordinary PyTorch.

Parameter names are Hugging Face ``LlamaForCausalLM`` names without the leading
``model.``, so HF checkpoints load with a key rename only. Nothing here knows
about parallelism: tensor/pipeline/ZeRO transforms are applied from outside.
Attention infers its head count from the projection output sizes, so a
tensor-parallel plan that shards q/k/v column-wise needs no model change.
"""
from __future__ import annotations

import copy
import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from bunsan.models.llama_config import LlamaConfig, flops_per_token, rope_type  # noqa: F401  (flops: re-exported)
from bunsan.models.moe import MoE
from bunsan.models.packing import packed_forward
from bunsan.models.saving import rms_norm, swiglu

def rope_inv_freq(config: LlamaConfig, device=None) -> torch.Tensor:
    """Rotary inverse frequencies (fp32), with HF's llama3 scaling when configured."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if rope_type(config.rope_scaling) == "llama3":
        s = config.rope_scaling
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(config: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_position_embeddings, head_dim] in fp32 (HF layout: halves repeated)."""
    return rope_at(config, torch.arange(config.max_position_embeddings, device=device))


def rope_at(config: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), head_dim] in fp32 at the given token positions: the rows of `rope_tables` for
    them, computed alike (a context-parallel shard's tokens sit at scattered global positions)."""
    inv = rope_inv_freq(config, positions.device)
    freqs = torch.outer(positions.to(torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, s, head_dim]; cos/sin: [s, head_dim], or [b, 1, s, head_dim] (each row at its own position)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # default device: where the model is built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale after casting back, exactly as HF does; backward keeps only the input
        # and the per-token rstd (models/saving.py)
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(h, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, h, bias=False)

    @staticmethod
    def native_gqa(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool,
                   capability: tuple[int, int] = (9, 0), training: bool = True) -> bool:
        """Whether attention hands SDPA the K/V heads as they are (``enable_gqa=True``) rather than repeated
        to every query head. Only where a fused kernel takes grouped heads (torch 2.13), so that no call that
        ran fused with repeated K/V lands on the math kernel (which materialises the s x s scores) instead:

          CPU           the flash kernel takes GQA with and without a mask, fp32 and 16-bit, in training
                        too: the same kernel as with repeated K/V, without the repeated copies
          CUDA 16-bit   FlashAttention-2 and cuDNN take GQA, without an attn_mask; flash needs sm80+, head_dim
                        a multiple of 8 and <= 256, and to train on sm86/sm89 (A10, L4, L40, RTX 30/40) <= 192
          CUDA fp32     only the memory-efficient kernel runs fp32 there, and it needs equal head counts
          CUDA + mask   the memory-efficient kernel takes the mask but not GQA; cuDNN takes both but declines
                        many shapes and is not first in line on every GPU, so K/V stay repeated
          other devices K/V stay repeated: equal head counts are what every SDPA kernel takes

        Depends only on static facts (device type and capability, dtype, shapes, grad mode) so torch.compile
        guards on it for free. The estimator prices attention's saved K/V with this same rule (for an sm90 GPU).
        """
        if device_type == "cpu":
            return True
        if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or masked:
            return False
        if capability < (8, 0) or head_dim % 8 or head_dim > 256:
            return False
        return not (training and capability in ((8, 6), (8, 9)) and head_dim > 192)

    def forward(self, x, cos, sin, kv_cache_layer=None):
        b, s, _ = x.shape
        # Head counts come from the tensors (-1), so TP-sharded projections just work.
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if hasattr(kv_cache_layer, "attend"):    # bunsan serve's paged cache attends over its blocks itself
            return self.o_proj(kv_cache_layer.attend(q, k, v).transpose(1, 2).reshape(b, s, -1))
        if kv_cache_layer is not None:
            k, v = kv_cache_layer.update(k, v)  # all keys so far: [b, kv, past+s, hd]
        total = k.shape[2]
        mask = getattr(kv_cache_layer, "attn_mask", None)   # rows of different lengths (bunsan.serve)
        causal = mask is None and total == s    # else one new token (s == 1) sees everything cached,
        if mask is None and total != s and s != 1:
            # or a chunk after a prefix: is_causal would align the mask top-left, so build it
            # bottom-right aligned: query i (absolute past+i) sees keys <= past+i.
            mask = torch.ones(s, total, dtype=torch.bool, device=x.device).tril(diagonal=total - s)
        n_rep = q.shape[1] // k.shape[1]
        capability = (9, 0)
        if q.device.type == "cuda":
            gpu = torch.cuda.get_device_properties(q.device)
            capability = (gpu.major, gpu.minor)
        gqa = n_rep > 1 and self.native_gqa(q.device.type, q.dtype, self.head_dim, mask is not None, capability,
                                            torch.is_grad_enabled())
        if n_rep > 1 and not gqa:
            # kv head j serves query heads j*n_rep..(j+1)*n_rep-1 (HF repeat_kv); enable_gqa groups them alike
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        if torch.is_grad_enabled():
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))   # saves gate and up only
        # generation: nothing saved, and gate is freed as soon as silu(gate) exists, before up is made
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: tensors in, tensor out, so torch.utils.checkpoint wraps it as is."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(config)
        moe = config.moe_config()
        self.mlp = MLP(config) if moe is None else MoE(moe)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope_cos, rope_sin, kv_cache_layer=None):
        x = x + self.self_attn(self.input_layernorm(x), rope_cos, rope_sin, kv_cache_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def seed_for(seed: int, name: str) -> int:
    # Per-parameter seed from (seed, name): weights do not depend on device, on
    # init order, or on which layers a pipeline stage holds.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = copy.deepcopy(config)  # own copy: shared presets stay untouched
        c = self.config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight  # same Parameter: listed once
        else:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # Non-persistent: recomputable, so kept out of state_dict and checkpoints.
        rope = (c.max_position_embeddings, c.head_dim)
        self.register_buffer("rope_cos", torch.empty(rope), persistent=False)  # default device: with the model
        self.register_buffer("rope_sin", torch.empty(rope), persistent=False)  # default device: with the model
        if not self.embed_tokens.weight.is_meta:  # on meta: allocate nothing, init after to_empty()
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every weight and recompute the rope tables.

        normal(0, initializer_range); RMSNorm = 1; o_proj/down_proj std scaled by
        1/sqrt(2*num_layers) (GPT-2/torchtitan). With ``seed`` each tensor is drawn
        on CPU from a generator seeded by (seed, name): identical on any device.
        """
        for name, p in self.named_parameters():
            self.init_parameter(name, p, seed)
        self.init_buffers()

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor, seed: int | None = None) -> None:
        """Initialise one tensor by its parameter name (lets ZeRO-3 build a model shard by shard)."""
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            return
        c = self.config
        std = c.initializer_range
        into_residual = name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2"))
        s = std / math.sqrt(2 * c.num_hidden_layers) if into_residual else std
        if seed is None:
            p.normal_(0.0, s)
        else:
            g = torch.Generator().manual_seed(seed_for(seed, name))
            # drawn by a CPU generator, so the weights are the same on any device
            drawn = torch.empty(p.shape, dtype=torch.float32)  # host: the generator's device
            p.copy_(drawn.normal_(0.0, s, generator=g))

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (rope tables) after materialising them; a MoE block's expert
        bias and token counts start at 0."""
        self.reset_rope()
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, MoE):
                    for b in (m.expert_bias, m.tokens_per_expert, m.dropped_per_expert):
                        b.zero_()

    def reset_parameters(self) -> None:
        self.init_weights()

    def _apply(self, fn, recurse=True):
        # to_empty()/to() may replace Parameter objects, which would silently untie the head.
        out = super()._apply(fn, recurse)
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight
        return out

    @torch.no_grad()
    def reset_rope(self) -> None:
        cos, sin = rope_tables(self.config, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    takes_documents = True     # the engine may feed packed rows' document_ids (engine/batch.py)

    def forward(self, input_ids: torch.Tensor, kv_cache=None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, vocab] (at kv_cache.keep's positions only, when it has some).

        ``kv_cache`` (see ``bunsan.models.generate.KVCache``) needs ``pos``,
        ``layer(i)`` returning an object with ``update(k, v)``, and ``advance(n)``.
        ``documents`` [b, s]: packed rows, each position's document id (models/packing.py).
        """
        if documents is not None:
            if kv_cache is not None:
                raise ValueError("documents (packed rows) are for training; generation takes one sequence per row")
            return packed_forward(self, input_ids, documents)
        s = input_ids.shape[1]
        at = getattr(kv_cache, "at", None)     # every token's own position [b, s] (bunsan serve's rows)
        start = kv_cache.pos if kv_cache is not None and at is None else 0
        end = start + s if at is None else int(at.max()) + 1   # host: serve's positions live on the CPU
        if end > self.rope_cos.shape[0]:
            raise ValueError(f"sequence end {end} exceeds max_position_embeddings "
                             f"{self.rope_cos.shape[0]}; shorten the input or raise max_position_embeddings")
        if at is None:
            cos, sin = self.rope_cos[start:start + s], self.rope_sin[start:start + s]
        else:
            at = at.to(self.rope_cos.device)
            cos, sin = self.rope_cos[at][:, None], self.rope_sin[at][:, None]
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache.layer(i) if kv_cache is not None else None)
        if kv_cache is not None:
            kv_cache.advance(s)
        keep = getattr(kv_cache, "keep", None)   # bunsan serve reads the logits of a few tokens only
        if keep is not None:
            x = x[:, keep.to(x.device)]
        return self.lm_head(self.norm(x))
