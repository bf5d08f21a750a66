"""A Hugging Face model's own tensor-parallel plan in bunsan's styles.

transformers ships the plan as data: `config.base_model_tp_plan` (paths under the base model, e.g.
"layers.*.self_attn.q_proj": "colwise") and the head's `_tp_plan` ({"lm_head": "colwise_gather_output"}).
Its styles are DTensor layouts; bunsan's layers implement the ones a decoder uses. What HF's plan leaves
implicit, bunsan spells out: the module that receives a block's input (the attention, the MLP) makes it
enter the parallel region once, and the embedding and head are split by vocabulary (the loss stays
vocabulary-parallel: logits are never gathered). A style bunsan does not implement is an error naming it.
"""

from __future__ import annotations

import fnmatch
import warnings

import torch.nn as nn

# HF style -> bunsan style, for the styles whose meaning bunsan's layers reproduce exactly
HF_STYLES = {"colwise": "column", "colwise_rep": "column_gather", "colwise_gather_output": "column_gather",
             "rowwise": "row", "rowwise_rep": "row_split_input", "rowwise_split_input": "row_split_input",
             "embedding_rowwise": "vocab_embedding", "sequence_parallel": "norm",
             "replicated_with_grad_allreduce": "grad_allreduce", "moe_tp_experts": "moe_experts"}
HEAD_STYLES = ("colwise_gather_output", "colwise_rep")   # a head whose logits HF gathers: bunsan's vocab_head
# bunsan's plans for encoder towers transformers ships none for, by encoder layer class (paths under the layer):
# Megatron's split of a ViT block (q/k/v and fc1 by columns, out_proj and fc2 by rows), each rank running its share
# of the heads. A CLIP or SigLIP attention reshapes to -1 heads; its attention and MLP modules take the block's
# input into the parallel region.
_VIT = {"self_attn": "parallel_input", "self_attn.q_proj": "column", "self_attn.k_proj": "column",
        "self_attn.v_proj": "column", "self_attn.out_proj": "row", "mlp": "parallel_input", "mlp.fc1": "column",
        "mlp.fc2": "row"}
# Whisper's encoder layer (Qwen2-Audio's is its copy) holds fc1 and fc2 itself, and its input also feeds the
# residual, so the layer cannot take its input into the parallel region (the residual's replicated gradient would
# be summed over the ranks): fc1's input enters it as final_layer_norm's output. Its attention views k and v by
# num_heads (a -1 sequence length), so it must be told its share of the heads (parallel_attention), or the
# keys would be silently re-cut along the sequence.
_WHISPER = {"self_attn": "parallel_attention", "self_attn.q_proj": "column", "self_attn.k_proj": "column",
            "self_attn.v_proj": "column", "self_attn.out_proj": "row", "final_layer_norm": "parallel_output",
            "fc1": "column", "fc2": "row"}
# Qwen2-VL's and Qwen2.5-VL's vision blocks: q, k and v fused in one qkv linear ([q; k; v] rows), which the
# attention unpacks by num_heads, so it is told its share of the heads and qkv gives each rank its rows of all three;
# the MLP (GELU fc1/fc2, or Qwen2.5-VL's SiLU-gated one) as a ViT's
_QWEN_VIT = {"attn": "parallel_attention", "attn.qkv": "column_qkv", "attn.proj": "row", "mlp": "parallel_input",
             "mlp.fc1": "column", "mlp.fc2": "row"}
_QWEN25_VIT = {"attn": "parallel_attention", "attn.qkv": "column_qkv", "attn.proj": "row",
               "mlp": "parallel_input", "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
ENCODER_PLANS = {"CLIPEncoderLayer": _VIT, "SiglipEncoderLayer": _VIT, "WhisperEncoderLayer": _WHISPER,
                 "Qwen2AudioEncoderLayer": _WHISPER, "Qwen2VLVisionBlock": _QWEN_VIT,
                 "Qwen2_5_VLVisionBlock": _QWEN25_VIT}


def is_hf_model(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def _translated(path: str, style: str, is_head: bool) -> str:
    if is_head and style in HEAD_STYLES:
        return "vocab_head"
    if style not in HF_STYLES:
        raise ValueError(f"the model's tensor-parallel plan gives {path!r} the style {style!r}, which bunsan does "
                         f"not implement (it maps {sorted(HF_STYLES)} and a head's {list(HEAD_STYLES)}); pass "
                         "tp_plan with bunsan's styles for this model")
    return HF_STYLES[style]


def hf_tp_plan(model: nn.Module, sequence_parallel: bool, encoders: str = "split", size: int = 1) -> dict[str, str]:
    """bunsan's plan (module pattern -> style) from the model's own, with the parallel inputs it implies;
    a composite model's CLIP, SigLIP or Whisper-style audio tower split by ENCODER_PLANS unless `encoders` is
    "whole" (a tower it has no split for is kept whole, and a warning says so)."""
    base_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    head_plan = dict(getattr(type(model), "_tp_plan", None) or {})
    # a composite model (LLaVA, Qwen2-VL, ...) keeps its language model's plan in text_config; transformers
    # assembles the whole model's plan, full paths, on the instance; its encoders have none (they stay whole)
    built = model.__dict__.get("_tp_plan") or {}
    if not base_plan and not built:
        raise ValueError(f"{type(model).__name__} ships no tensor-parallel plan (config.base_model_tp_plan is "
                         "empty); pass tp_plan={module pattern: style} with bunsan's styles (column, row, "
                         "parallel_input, vocab_embedding, vocab_head, norm)")
    prefix = f"{model.base_model_prefix}." if getattr(model, model.base_model_prefix, None) is not model else ""
    base_plan = _experts_folded(base_plan, sequence_parallel, model)
    if base_plan:
        plan = {f"{prefix}{path}": _translated(path, style, False) for path, style in base_plan.items()}
        plan |= {path: _translated(path, style, True) for path, style in head_plan.items()}
    else:
        if sequence_parallel:
            raise ValueError(f"tensor_parallel.sequence_parallel with {type(model).__name__}: its encoders (vision, "
                             "audio) run whole on every rank and bunsan cuts no sequence inside a composite model; "
                             "set sequence_parallel to false")
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        heads = {n for n, m in model.named_modules() if m is head and head is not None}
        plan = {path: _translated(path, style, path in heads) for path, style in built.items()}
    # the model's own plan covers its config's variants (Qwen2-MoE's dense MLP entries when every layer is sparse):
    # an entry naming no module of this model has nothing to split
    names = [name for name, _ in model.named_modules() if name]
    plan = {p: s for p, s in plan.items() if any(fnmatch.fnmatchcase(name, p) for name in names)}
    for path, style in list(plan.items()):
        if style in ("column", "column_gather"):   # the module that calls q/k/v (gate/up) gets the block's input
            plan.setdefault(path.rpartition(".")[0], "parallel_input")
    if not base_plan and encoders == "split":      # (after: an encoder plan says where its inputs enter)
        plan |= encoder_plan(model, size)
        _say_whole_towers(model)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and "vocab_head" in plan.values():
        name = next(n for n, m in model.named_modules() if m is embed)
        plan.setdefault(name, "vocab_embedding")
    if sequence_parallel:
        if not any(style in ("column", "column_gather", "parallel_input") for style in plan.values()):
            raise ValueError(f"tensor_parallel.sequence_parallel with {type(model).__name__}: its plan splits no "
                             "attention or MLP input, so nothing would gather the sequence back; set "
                             "sequence_parallel to false")
        # the sequence is cut at the first decoder layer: the model reads the embedding's length to build its
        # mask and positions, so the embedding's output stays whole
        for name, style in plan.items():
            if style == "vocab_embedding":
                plan[name] = "vocab_embedding_whole"
        plan |= _sequence_parallel_extras(model, prefix)
    return plan


def _experts_folded(plan: dict, sequence_parallel: bool, model: nn.Module) -> dict:
    """`plan` with a packed experts module's parameter entries ("...experts.gate_up_proj": "packed_colwise",
    "...experts.down_proj": "rowwise") left to its "moe_tp_experts" entry, which splits them (hf_moe.py), after
    checking each has the style that split means."""
    from bunsan.tensor_parallel.hf_moe import EXPERT_PARAM_STYLES
    experts = [path for path, style in plan.items() if style == "moe_tp_experts"]
    if not experts:
        return plan
    if sequence_parallel:
        raise ValueError(f"tensor_parallel.sequence_parallel with {type(model).__name__}'s MoE blocks: bunsan "
                         "splits their experts without cutting the sequence; set sequence_parallel to false")
    if getattr(model.config, "router_jitter_noise", 0) or getattr(model.config, "jitter_noise", 0):
        raise ValueError(f"{type(model).__name__} has router jitter noise on: each tensor-parallel rank would draw "
                         "its own and route the tokens differently; set the config's router_jitter_noise to 0")
    out = {}
    for path, style in plan.items():
        owner, _, attr = path.rpartition(".")
        if owner in experts:
            if EXPERT_PARAM_STYLES.get(attr) != style:
                raise ValueError(f"the model's tensor-parallel plan gives {path!r} the style {style!r}; bunsan "
                                 f"splits {owner}'s parameters as {EXPERT_PARAM_STYLES} only")
            continue
        out[path] = style
    return out


def encoder_plan(model: nn.Module, size: int) -> dict[str, str]:
    """ENCODER_PLANS over the model's encoder layers, full paths; their heads and MLP width must divide."""
    plan = {}
    for name, layer in model.named_modules():
        styles = ENCODER_PLANS.get(type(layer).__name__)
        if styles is None:
            continue
        attention = layer.get_submodule(next(p for p in styles if p.endswith("attn")))
        first = layer.get_submodule(next(p for p, style in styles.items() if style == "column" and "attn" not in p))
        heads, width = attention.num_heads, first.out_features
        if heads % size or width % size:
            raise ValueError(f"{name} ({type(layer).__name__}) has {heads} attention heads and an MLP of {width}: "
                             f"tensor parallelism {size} must divide both; set tensor_parallel.encoders to "
                             "\"whole\" to keep the tower whole on every rank")
        plan |= {f"{name}.{path}": style for path, style in styles.items()}
    return plan


def whole_towers(model: nn.Module) -> dict[str, list[str]]:
    """A composite model's encoder towers (path -> their block classes) that ENCODER_PLANS has no split for."""
    from bunsan.models.blocks import repeated_blocks
    from bunsan.models.hf_layout import encoder_paths
    blocks = repeated_blocks(model)
    out = {}
    for path in encoder_paths(model):
        tower = set(map(id, model.get_submodule(path).modules()))
        kinds = sorted({type(b).__name__ for b in blocks if id(b) in tower})
        if kinds and not any(k in ENCODER_PLANS for k in kinds):
            out[path] = kinds
    return out


def _say_whole_towers(model: nn.Module) -> None:
    for path, kinds in whole_towers(model).items():
        warnings.warn(f"tensor_parallel.encoders is \"split\", but {path} ({', '.join(kinds)}) has no split bunsan "
                      "implements (tensor_parallel/hf_plan.py ENCODER_PLANS): it is kept whole, computed in full on "
                      "every tensor-parallel rank; set tensor_parallel.encoders to \"whole\" to say so",
                      stacklevel=3)


def _sequence_parallel_extras(model: nn.Module, prefix: str) -> dict[str, str]:
    """Where HF's plan is silent under SP: the sequence is cut at the first decoder layer's input, and every
    norm (which then sees a slice of the sequence) sums its gradient over the group."""
    blocks = getattr(getattr(model, model.base_model_prefix, model), "layers", None)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        raise ValueError(f"tensor_parallel.sequence_parallel with {type(model).__name__}: bunsan cuts the sequence "
                         "at the first decoder layer (base_model.layers), which this model does not have; set "
                         "sequence_parallel to false")
    extras = {f"{prefix}layers.0": "sequence_split"}
    for name, m in model.named_modules():
        if name and type(m).__name__.endswith(("RMSNorm", "LayerNorm")):
            extras[name] = "norm"
    return extras
