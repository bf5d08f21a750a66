"""bunsan's Llama with MoE blocks, in transformers' Mixtral form and back: config.json fields and tensor names.

A Mixtral block is bunsan's MoE block with softmax scores renormalised over the top k, no shared experts, no
groups and no expert bias; its hub checkpoints keep one tensor per expert,

    model.layers.{i}.block_sparse_moe.gate.weight             [E, h]      <- layers.{i}.mlp.gate.weight
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight   [I, h]      <- layers.{i}.mlp.experts.w1[e]
    (w3 likewise; w2 [h, I])

which transformers 5 packs into its 3-D experts on load. A MoE config Mixtral cannot express is refused when
written, naming the field. Mixtral's router_aux_loss_coef is top_k times MoEConfig.aux_loss_coef
(models/moe_router.py: transformers' loss is top_k times bunsan's). bunsan's own MoE fields are kept under
"bunsan_moe" as well, so capacity, z-loss and the rest come back as they were.
"""
from __future__ import annotations

import re

import torch

from bunsan.models.moe_config import MoEConfig

BUNSAN_MOE = "bunsan_moe"
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w[123])$")
_HUB_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def mixtral_problems(moe: MoEConfig) -> list[str]:
    """What keeps a MoE config from being a Mixtral block (empty: it is one)."""
    wants = {"score_func": "softmax", "normalizes_routes": True, "route_scale": 1.0, "n_groups": 1,
             "num_shared_experts": 0, "expert_bias_update_rate": 0.0}
    return [f"{k} {getattr(moe, k)!r} (Mixtral: {v!r})" for k, v in wants.items() if getattr(moe, k) != v]


def to_mixtral(hf: dict, moe: MoEConfig, fields: dict) -> dict:
    """A Llama config.json dict (`hf`) made Mixtral's, for the MoE block `moe` (given as `fields`)."""
    problems = mixtral_problems(moe)
    if problems:
        raise ValueError(f"a MoE Llama is written in transformers' Mixtral form, which cannot hold "
                         f"{', '.join(problems)}; train with a Mixtral-form moe config to export it")
    out = {k: v for k, v in hf.items() if k not in ("moe", "mlp_bias")}
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               intermediate_size=moe.expert_intermediate_size, num_local_experts=moe.num_experts,
               num_experts_per_tok=moe.top_k,
               router_aux_loss_coef=moe.aux_loss_coef * moe.top_k, output_router_logits=False,
               router_jitter_noise=0.0, sliding_window=None)
    out[BUNSAN_MOE] = dict(fields)
    return out


def from_mixtral(d: dict) -> dict:
    """The LlamaConfig fields of a Mixtral config.json dict `d` (its moe from bunsan_moe when bunsan wrote it)."""
    if d.get("sliding_window") not in (None, 0):
        raise ValueError(f"sliding_window {d['sliding_window']} is not supported: bunsan's attention is full")
    if d.get("router_jitter_noise", 0.0):
        raise ValueError(f"router_jitter_noise {d['router_jitter_noise']} is not supported: bunsan's router "
                         "adds no noise")
    moe = d.get(BUNSAN_MOE)
    if moe is None:
        k = d.get("num_experts_per_tok", 2)
        moe = {"num_experts": d.get("num_local_experts", 8), "top_k": k,
               "expert_intermediate_size": d.get("intermediate_size", 14336), "route_norm": True,
               "aux_loss_coef": d.get("router_aux_loss_coef", 0.001) / k}
    return {**{k: v for k, v in d.items() if k != BUNSAN_MOE}, "moe": moe}


def to_hub_tensors(name: str, t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """A bunsan MoE tensor under Mixtral's hub names (one per expert); None for a tensor named as Llama's
    (attention, norms, embedding, head). The expert bias, all zeros in a Mixtral-form block, is not written."""
    m = _EXPERT.match(name)
    if m:
        layer, w = m.groups()
        return {f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight": t[e] for e in range(t.shape[0])}
    if re.fullmatch(r"layers\.\d+\.mlp\.gate\.weight", name):
        return {"model." + name.replace(".mlp.", ".block_sparse_moe."): t}
    if re.fullmatch(r"layers\.\d+\.mlp\.expert_bias", name):
        if torch.count_nonzero(t):
            raise ValueError(f"{name} is not zero: a Mixtral block has no expert bias; set "
                             "expert_bias_update_rate 0 to train a Mixtral-form model")
        return {}
    return None


def from_hub_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Mixtral hub state dict (one tensor per expert) under bunsan's MoE Llama names: each layer's experts
    stacked into its 3-D weights, the router renamed, a zero expert bias per layer (a Mixtral has none);
    every other tensor kept under its own name. An expert index missing from a layer is an error."""
    out, experts = {}, {}
    for key, t in state.items():
        m = _HUB_EXPERT.match(key)
        if m:
            layer, e, w = m.groups()
            experts.setdefault((layer, w), {})[int(e)] = t
        elif re.fullmatch(r"model\.layers\.\d+\.block_sparse_moe\.gate\.weight", key):
            out[key.replace(".block_sparse_moe.", ".mlp.")] = t
        else:
            out[key] = t
    for (layer, w), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"layer {layer}'s {w} experts are {sorted(per)}: an expert is missing")
        out[f"model.layers.{layer}.mlp.experts.{w}"] = torch.stack([per[e] for e in range(len(per))])
        bias = f"model.layers.{layer}.mlp.expert_bias"
        out.setdefault(bias, torch.zeros(len(per), dtype=torch.float32))
    return out


def hub_name(name: str) -> tuple[str, int | None]:
    """Where bunsan's parameter `name` of a MoE Llama is in a Mixtral hub checkpoint: (key, expert index
    along dim 0, or None for a whole tensor); the experts' key has {e} for the expert."""
    m = _EXPERT.match(name)
    if m:
        layer, w = m.groups()
        return f"model.layers.{layer}.block_sparse_moe.experts.{{e}}.{w}.weight", 0
    if re.fullmatch(r"layers\.\d+\.mlp\.gate\.weight", name):
        return "model." + name.replace(".mlp.", ".block_sparse_moe."), None
    return (name if name.startswith("lm_head.") else f"model.{name}"), None


def is_hub_expert(key: str) -> bool:
    return _HUB_EXPERT.match(key) is not None
