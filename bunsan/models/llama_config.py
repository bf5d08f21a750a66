"""The shape of bunsan's Llama: its config (Hugging Face's `config.json` fields, read and written), parameter
counts and training FLOPs per token. models/llama.py builds the model from it."""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from bunsan.models.mixtral_form import from_mixtral, to_mixtral
from bunsan.models.moe_config import MoEConfig


def rope_type(scaling: dict | None) -> str:
    """The rotary scaling a config's rope_scaling names ("default" when none)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
)


@dataclass
class LlamaConfig:
    """Llama shape. Field names match HF ``config.json`` so it maps 1:1."""

    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None  # None -> num_attention_heads (plain MHA)
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # HF rope_scaling: None/"default" or {"rope_type": "llama3", ...} (Llama 3.1/3.2).
    rope_scaling: dict | None = field(default=None)
    # Width of one attention head. None -> hidden_size / num_attention_heads; set apart from that (Mistral
    # Nemo's 128 with 5120 / 32, NVIDIA's width-pruned Minitron), q_proj and o_proj are heads x head_dim wide.
    # Resolved at construction, as transformers' LlamaConfig does: dataclasses.replace keeps it as it was,
    # LlamaConfig.replace derives it again from a new width or head count
    head_dim: int | None = None
    # Mixture of experts: None (a dense SwiGLU MLP in every block), or bunsan's MoE block (models/moe.py) in
    # every block, given as MoEConfig's fields but hidden_size (the model's), e.g. {"num_experts": 8,
    # "top_k": 2, "expert_intermediate_size": 344}; intermediate_size is then unused
    moe: dict | None = field(default=None)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        derived = self.head_dim is None
        for name in _POSITIVE_INTS + (() if derived else ("head_dim",)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {v!r}")
        if not isinstance(self.initializer_range, (int, float)) or self.initializer_range < 0:
            raise ValueError(f"LlamaConfig.initializer_range must be >= 0, got {self.initializer_range!r}")
        h, nh, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if derived:
            if h % nh:
                raise ValueError(
                    f"LlamaConfig.hidden_size {h} is not divisible by num_attention_heads {nh}; pick hidden_size "
                    f"a multiple of {nh} (e.g. {nh * max(1, round(h / nh))}), change the head count or give head_dim")
            self.head_dim = h // nh
        if nh % kv:
            raise ValueError(
                f"LlamaConfig.num_attention_heads {nh} is not divisible by num_key_value_heads {kv}; "
                f"set num_key_value_heads to a divisor of {nh} (e.g. {math.gcd(nh, kv)})")
        if self.head_dim % 2:
            said = (f"head_dim = hidden_size {h} / num_attention_heads {nh} = {self.head_dim}" if derived
                    else f"head_dim {self.head_dim}")
            raise ValueError(f"LlamaConfig {said} is odd; rotary embeddings rotate pairs, so choose an even head_dim")
        rtype = rope_type(self.rope_scaling)
        if rtype not in ("default", "llama3"):
            raise ValueError(f"LlamaConfig.rope_scaling type {rtype!r} is not supported; use None or 'llama3'")
        if self.moe is not None:
            self.moe_config()       # checked field by field now, not when the model is built

    def moe_config(self) -> MoEConfig | None:
        """The MoE block's config (None: dense MLPs), with the model's hidden_size."""
        if self.moe is None:
            return None
        if not isinstance(self.moe, dict):
            raise ValueError(f"LlamaConfig.moe must be None or a dict of MoEConfig fields, got "
                             f"{type(self.moe).__name__}")
        fields = {f.name for f in dataclasses.fields(MoEConfig)} - {"hidden_size"}
        unknown = sorted(set(self.moe) - fields)
        if unknown:
            hints = [u + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, fields, n=1)) else "")
                     for u in unknown]
            raise ValueError(f"LlamaConfig.moe has unknown field(s) {', '.join(hints)}; it takes "
                             f"{', '.join(sorted(fields))} (hidden_size is the model's)")
        return MoEConfig(hidden_size=self.hidden_size, **self.moe)

    @property
    def attention_dim(self) -> int:
        """Width of the query heads together (q_proj's output, o_proj's input): hidden_size unless head_dim is
        set apart from hidden_size / num_attention_heads."""
        return self.num_attention_heads * self.head_dim

    @property
    def head_dim_derived(self) -> bool:
        """Whether head_dim is hidden_size / num_attention_heads."""
        return self.num_attention_heads * self.head_dim == self.hidden_size

    def replace(self, **changes) -> LlamaConfig:
        """A validated copy with `changes`. A head_dim that was hidden_size / num_attention_heads is derived
        again when either changes (unless `changes` names head_dim), so a wider preset keeps its head count."""
        if self.head_dim_derived and "head_dim" not in changes and {"hidden_size", "num_attention_heads"} & {*changes}:
            changes = {**changes, "head_dim": None}
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Exact parameter count (equals ``sum(p.numel())`` of ``Llama(self)``).

        ``include_embedding=False`` drops the input embedding table only. A tied
        table is still counted once as the LM head, since its matmul does work
        (nanoGPT's convention for MFU). ``active=True`` counts the routed experts
        a token passes (top_k of num_experts) instead of all of them: the
        parameters whose matmuls one token's forward does.
        """
        h, kv_dim = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = 2 * h * self.attention_dim + 2 * h * kv_dim
        moe = self.moe_config()
        if moe is None:
            mlp = 3 * h * self.intermediate_size
        else:
            experts = moe.top_k if active else moe.num_experts
            mlp = h * moe.num_experts + 3 * h * (experts * moe.expert_intermediate_size + moe.shared_width)
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        total = self.num_hidden_layers * per_layer + h + emb  # + final norm + lm_head (or tied table)
        if not self.tie_word_embeddings:
            total += emb  # the separate input embedding
        return total if include_embedding or self.tie_word_embeddings else total - emb

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Build from a HF ``config.json`` dict; unrelated keys are ignored."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (Llama uses 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"{key}=true is not supported: this Llama has no biases")
        if d.get("model_type") == "mixtral":     # a MoE Llama (models/mixtral_form.py)
            d = from_mixtral(d)
        d = rope_fields(d)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_hf(self) -> dict[str, Any]:
        """The config.json of this shape: transformers' Llama, or its Mixtral for a MoE Llama."""
        d = dataclasses.asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 attention_bias=False, mlp_bias=False, head_dim=self.head_dim)
        return d if self.moe is None else to_mixtral(d, self.moe_config(), self.moe)


def rope_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict with transformers 5's `rope_parameters` ({"rope_theta", "rope_type", and the
    scaling's own fields}) read as the rope_theta and rope_scaling fields earlier versions write; the two
    forms disagreeing is an error rather than a guess."""
    params = d.get("rope_parameters")
    if params is None:
        return d
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a JSON object, got {params!r}")
    d = dict(d)
    theta = params.get("rope_theta")
    if theta is not None:
        if d.get("rope_theta") is not None and d["rope_theta"] != theta:
            raise ValueError(f"rope_theta {d['rope_theta']} and rope_parameters.rope_theta {theta} disagree; "
                             "keep one of them")
        d["rope_theta"] = theta
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if rope_type(scaling) != "default":
        if d.get("rope_scaling") and rope_type(d["rope_scaling"]) != rope_type(scaling):
            raise ValueError(f"rope_scaling {d['rope_scaling']} and rope_parameters {params} disagree; keep one "
                             "of them")
        d["rope_scaling"] = scaling
    return d


def flops_per_token(config: LlamaConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6N + 12*L*h*s.

    N = ``config.num_params(include_embedding=False, active=True)``: every parameter a
    token's forward multiplies by (a MoE block's top_k experts, not all) except the
    input embedding lookup (which does no matmul); the LM head counts, tied or not
    (nanoGPT/PaLM convention). 12*L*h*s is the attention score/value matmuls, h the
    query heads' width (``attention_dim``: hidden_size unless head_dim is set apart).
    """
    n = config.num_params(include_embedding=False, active=True)
    return 6 * n + 12 * config.num_hidden_layers * config.attention_dim * seq_len
