"""A tensor-parallel plan is data: module path (fnmatch pattern) -> style. Applying it swaps layers in place.

Styles:
    column          nn.Linear -> ColumnParallelLinear (output rows split)
    column_gather   the same, its output all-gathered: whole on every rank
    column_qkv      a fused [q; k; v] projection of equal parts: each rank takes its rows of each (its heads')
    row             nn.Linear -> RowParallelLinear (input columns split, outputs summed)
    row_split_input the same, fed a whole input (each rank takes its columns)
    parallel_input  any module: its input enters the parallel region once (f / SP all-gather)
    parallel_attention  the same for an attention that views its heads by `num_heads` (Whisper's): it is set to
                    the rank's share, num_heads / tp
    parallel_output any module: its output enters the parallel region (a norm feeding a column split directly)
    vocab_embedding nn.Embedding -> VocabParallelEmbedding
    vocab_embedding_whole   the same, its output the whole sequence under SP (split later, at sequence_split)
    sequence_split  any module: under SP its whole-sequence input becomes this rank's slice
    vocab_head      nn.Linear -> VocabParallelHead (+ parallel input), for the vocabulary-parallel loss
    norm            replicated; under sequence parallelism its gradient is summed over the group
    grad_allreduce  replicated, but each rank's gradient covers its own heads only (Qwen3's q_norm / k_norm):
                    summed over the group always

The model code never changes: picotron's table of (module, style), torchtitan's plan-as-dict.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn

from bunsan.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, check_splittable, parallel_input_hook, split_sequence_hook, sum_grad_over_tp)
from bunsan.tensor_parallel.hf_plan import hf_tp_plan, is_hf_model
from bunsan.models.llama import Llama
from bunsan.models.moe import MoE
from bunsan.tensor_parallel.moe import split_moe_block
from bunsan.tensor_parallel.hf_moe import split_hf_experts
from bunsan.tensor_parallel.ops import TPContext, into_parallel_region

LLAMA_PLAN = {
    "embed_tokens": "vocab_embedding",
    "layers.*.input_layernorm": "norm",
    "layers.*.self_attn": "parallel_input",
    "layers.*.self_attn.q_proj": "column",
    "layers.*.self_attn.k_proj": "column",
    "layers.*.self_attn.v_proj": "column",
    "layers.*.self_attn.o_proj": "row",
    "layers.*.post_attention_layernorm": "norm",
    "layers.*.mlp": "parallel_input",
    "layers.*.mlp.gate_proj": "column",
    "layers.*.mlp.up_proj": "column",
    "layers.*.mlp.down_proj": "row",
    "norm": "norm",
    "lm_head": "vocab_head",
}


def _style_of(name: str, plan: dict) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _check_divisible(name: str, what: str, n: int, tp: int, hint: str) -> None:
    if n % tp:
        raise ValueError(f"tensor_parallel.size {tp} does not divide {name}'s {what} ({n}); {hint}")


def check_llama(config, tp: int, dense_mlp: bool = True) -> None:
    """Heads and sizes of a Llama must split evenly; grouped-query key/value heads too (a MoE block's widths:
    tensor_parallel/moe.py)."""
    sizes = (("num_attention_heads", config.num_attention_heads),) + \
        ((("intermediate_size", config.intermediate_size),) if dense_mlp else ())
    for field, n in sizes:
        _check_divisible("the model", field, n, tp, f"use a tensor-parallel size that divides {n}")
    kv = config.num_key_value_heads
    _check_divisible("the model", "num_key_value_heads", kv, tp,
                     f"grouped-query attention has {kv} key/value heads, which cannot be split over {tp} ranks; "
                     f"use a tensor-parallel size that divides {kv}")


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _split_lora(name: str, m: nn.Module, style: str, ctx: TPContext) -> None:
    """A peft LoRA layer (base + B A): split the adapter with its base so that the sum stays each rank's part.

    column: base and B split by output rows, A replicated. A sees the whole input but only this rank's rows
    of B, so its gradient is partial: summed over the group.
    row:    base and A split by input columns, each rank's A x_r summed over the group (an r-wide all-reduce,
    or reduce-scatter under SP) before B, which is replicated. Under SP B sees a slice of the sequence: its
    gradient is summed over the group like a norm's.
    """
    base = m.base_layer
    if style in ("column", "column_qkv"):
        sections = 3 if style == "column_qkv" else 1
        _check_divisible(name, "output features", base.out_features, sections * ctx.size,
                         "change tensor_parallel.size")
        m.base_layer = ColumnParallelLinear(base, ctx, sections=sections)
        for key in list(m.lora_B.keys()):   # fed by lora_A
            m.lora_B[key] = ColumnParallelLinear(m.lora_B[key], ctx, check_input=False, sections=sections)
            sum_grad_over_tp(m.lora_A[key].weight, ctx)
    else:
        _check_divisible(name, "input features", base.in_features, ctx.size, "change tensor_parallel.size")
        m.base_layer = RowParallelLinear(base, ctx)
        for key in list(m.lora_A.keys()):
            m.lora_A[key] = RowParallelLinear(m.lora_A[key], ctx)
            if ctx.sequence_parallel:
                sum_grad_over_tp(m.lora_B[key].weight, ctx)


STYLES = ("column", "column_gather", "column_qkv", "row", "row_split_input", "parallel_input", "parallel_attention",
          "parallel_output", "vocab_embedding", "vocab_embedding_whole", "sequence_split", "vocab_head", "norm",
          "grad_allreduce", "moe", "moe_experts")

# bunsan's Llama with a MoE block in every layer: the block is split as a whole (tensor_parallel/moe.py)
MOE_LLAMA_PLAN = {**{k: v for k, v in LLAMA_PLAN.items() if not k.startswith("layers.*.mlp")},
                  "layers.*.mlp": "moe"}


def resolve_plan(model: nn.Module, ctx: TPContext, plan: dict | str | None) -> dict:
    """The plan to apply: the user's, a Hugging Face model's own ("auto", and by default for one), or the
    Llama plan (by default for any other model)."""
    if plan == "auto" or (plan is None and is_hf_model(model)):
        if not is_hf_model(model):
            raise ValueError(f"tp_plan='auto' reads a Hugging Face model's own plan; {type(model).__name__} is not "
                             "a transformers PreTrainedModel: pass tp_plan={module pattern: style}")
        plan = hf_tp_plan(model, ctx.sequence_parallel, ctx.encoders, ctx.size)
    elif plan is None:
        moe = getattr(getattr(model, "config", None), "moe", None)
        plan = MOE_LLAMA_PLAN if isinstance(model, Llama) and moe is not None else LLAMA_PLAN
    if not isinstance(plan, dict):
        raise TypeError(f"tp_plan must be a dict of module pattern -> style or 'auto', got {plan!r}")
    unknown = sorted({s for s in plan.values()} - set(STYLES))
    if unknown:
        raise ValueError(f"unknown tensor-parallel style(s) {unknown}; use {', '.join(STYLES)}")
    config = getattr(model, "config", None)
    # (a decoder's config; Whisper's maps num_key_value_heads to its encoder's heads, and its layers' heads and
    # widths are checked by the encoder plan)
    if config is not None and hasattr(config, "num_key_value_heads") and hasattr(config, "intermediate_size"):
        check_llama(config, ctx.size, dense_mlp="moe" not in plan.values())
    return plan


def check_plan_matches(model: nn.Module, plan: dict) -> None:
    """Every pattern names a module of the (whole) model: a typo would leave a layer unsplit, silently."""
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [p for p in plan if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    if unmatched:
        raise ValueError(f"tensor-parallel plan pattern(s) {unmatched} match no module of {type(model).__name__}; "
                         "a plan names module paths (model.named_modules()): fix or remove them")


def apply_tensor_parallel(model: nn.Module, ctx: TPContext, plan: dict | str | None = None,
                          stage_only: bool = False):
    """Swap the layers named by `plan` (see resolve_plan) for their tensor-parallel versions. `stage_only`:
    `model` is one pipeline stage's part and `plan` was resolved and checked against the whole model.

    Returns the vocabulary-parallel head, if any (the engine computes the loss with it).
    """
    if not stage_only:
        plan = resolve_plan(model, ctx, plan)
        check_plan_matches(model, plan)
    head, embedding = None, None
    matched = [(name, m, _style_of(name, plan)) for name, m in list(model.named_modules()) if name]
    for name, m, style in matched:
        if style in ("vocab_embedding", "vocab_embedding_whole"):
            embedding = VocabParallelEmbedding(m, ctx, whole_output=style == "vocab_embedding_whole")
            _set(model, name, embedding)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, m, style in matched:
        if style in ("column", "column_qkv", "row") and hasattr(m, "base_layer") and hasattr(m, "lora_A"):
            _split_lora(name, m, style, ctx)
        elif style in ("column", "column_gather"):
            check_splittable(m, style)
            _check_divisible(name, "output features", m.out_features, ctx.size, "change tensor_parallel.size")
            _set(model, name, ColumnParallelLinear(m, ctx, gather_output=style == "column_gather"))
        elif style == "column_qkv":
            check_splittable(m, style)
            _check_divisible(name, "output features (q, k and v)", m.out_features, 3 * ctx.size,
                             "change tensor_parallel.size")
            _set(model, name, ColumnParallelLinear(m, ctx, sections=3))
        elif style in ("row", "row_split_input"):
            check_splittable(m, style)
            _check_divisible(name, "input features", m.in_features, ctx.size, "change tensor_parallel.size")
            _set(model, name, RowParallelLinear(m, ctx, split_input=style == "row_split_input"))
        elif style == "parallel_input":
            if _holds_split_experts(name, matched):     # (their own hooks take the input in: tensor_parallel/hf_moe.py)
                continue
            m.register_forward_pre_hook(parallel_input_hook(ctx), with_kwargs=True)
        elif style == "moe_experts":
            split_hf_experts(m, name, ctx)
        elif style == "moe":
            if not isinstance(m, MoE):
                raise ValueError(f"tensor-parallel style 'moe' splits bunsan's MoE block; {name} is a "
                                 f"{type(m).__name__}")
            split_moe_block(m, name, ctx)
            m.register_forward_pre_hook(parallel_input_hook(ctx), with_kwargs=True)
        elif style == "parallel_attention":
            heads = getattr(m, "num_heads", None)
            if not isinstance(heads, int):
                raise ValueError(f"parallel_attention: {name} ({type(m).__name__}) has no num_heads to set to this "
                                 "rank's share; mark it parallel_input if it reshapes to -1 heads")
            _check_divisible(name, "attention heads", heads, ctx.size, "change tensor_parallel.size")
            m.num_heads = heads // ctx.size      # (the module is the rank's own: it is split once)
            m.register_forward_pre_hook(parallel_input_hook(ctx), with_kwargs=True)
        elif style == "parallel_output":
            m.register_forward_hook(lambda module, args, out: into_parallel_region(ctx, out))
        elif style == "sequence_split" and ctx.sequence_parallel:
            m.register_forward_pre_hook(split_sequence_hook(ctx), with_kwargs=True)
        elif style == "vocab_head":
            head = VocabParallelHead(m, ctx, tied=embedding if tied else None)
            _set(model, name, head)
        elif (style == "norm" and ctx.sequence_parallel) or style == "grad_allreduce":
            for p in m.parameters():
                sum_grad_over_tp(p, ctx)
    return head


def _holds_split_experts(name: str, matched: list) -> bool:
    """Whether the module `name` holds a transformers experts module split as "moe_experts" (a MoE block, which
    a dense layer's plan entry also names as its MLP)."""
    return any(style == "moe_experts" and other.startswith(name + ".") for other, _, style in matched)


def tp_sections_of(module: nn.Module, pname: str) -> int:
    """How many sections a split parameter packs along its split dim (each rank holds its rows of every one)."""
    sections = getattr(module, "tp_sections", 1)
    return sections.get(pname, 1) if isinstance(sections, dict) else sections


def replicated_parameter_names(model: nn.Module) -> set[str]:
    """Parameters no style split (norms, biases of row layers, LoRA factors left whole): every TP rank holds
    the same values, so the gradient norm counts them on one rank only."""
    return {f"{name}.{pname}" if name else pname for name, m in model.named_modules()
            for pname, _ in m.named_parameters(recurse=False, remove_duplicate=False)
            if pname not in getattr(m, "tp_split", {})}


def consolidate(state: dict[str, torch.Tensor], model: nn.Module, ctx: TPContext,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Full tensors from tensor-parallel shards (all-gathered over the group), under the plain model's keys."""
    out = dict(state)
    for name, m in model.named_modules():
        for pname, (full_shape, dim) in getattr(m, "tp_split", {}).items():
            key = f"{name}.{pname}" if name else pname
            if key not in state:
                continue
            moved = state[key].movedim(dim, 0).contiguous().to(device)   # NCCL gathers device tensors
            full = torch.empty((moved.shape[0] * ctx.size, *moved.shape[1:]), dtype=moved.dtype, device=device)
            ctx.comm.all_gather(full, moved, ctx.group)
            sections = tp_sections_of(m, pname)
            if sections > 1:     # [rank, section, rows] -> [section, rank, rows]: each section's rows in order
                rest = moved.shape[1:]
                full = full.view(ctx.size, sections, -1, *rest).transpose(0, 1).reshape(-1, *rest)
            out[key] = full[:full_shape[dim]].movedim(0, dim).contiguous().cpu()
    return out
