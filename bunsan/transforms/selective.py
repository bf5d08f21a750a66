"""Selective activation recompute (`activation_checkpointing.mode: selective`): each block is checkpointed,
but the outputs of its matmuls are kept, so backward re-runs only the cheap ops and, by choice, the
attention core; no matmul runs twice except the output projection where tensor parallelism reduces it.

A block is recomputed by torch's selective checkpointing (torch.utils.checkpoint with a policy, as
torchtitan's op-level mode): every op of the block runs under a policy that says whether its output is
kept (MUST_SAVE) or recomputed in backward (PREFER_RECOMPUTE). The policy knows where an op runs from
forward hooks on the block's submodules, so it works for any Llama-shaped block, bunsan's or a Hugging Face
one, without touching the model:

  kept        the block input (what checkpoint keeps), the outputs of q_proj, k_proj, v_proj, gate_proj,
              up_proj (the inputs of the attention core and of the SwiGLU), and the output of o_proj when it
              is a plain nn.Linear, else (a tensor-parallel row layer all-reduces its output in place, which
              the policy cannot keep) the residual stream after attention, the same bytes
  recomputed  the RMSNorms, rotary embeddings and grouped K/V, the attention core (SDPA) unless `ops` leaves
              "attention" out, the SwiGLU silu(gate) * up unless it leaves "swiglu" out (then their outputs
              are kept); the sequence-parallel all-gathers into attention and MLP (as Megatron does for the
              matmul inputs it saves as shards); o_proj when it is not kept; never down_proj: the recompute
              stops once the last saved tensor, down_proj's input, is made (checkpoint's early stop)

Against Megatron's "selective" (recompute the attention core, keep the matmul inputs) this also drops the
normalised inputs and the attention and SwiGLU outputs, which a flash-attention block would otherwise keep:
with SDPA's fused kernels there is no s x s score left for the attention core to give back.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from bunsan.models.blocks import SELECTIVE_OPS
from bunsan.transforms.checkpointing import transformer_blocks

ATTENTION, MLP = "self_attn", "mlp"
INPUT_PROJECTIONS = {ATTENTION: ("q_proj", "k_proj", "v_proj"), MLP: ("gate_proj", "up_proj")}
OUTPUT_PROJECTIONS = {ATTENTION: "o_proj", MLP: "down_proj"}
# SDPA's fused kernels, one op each: the attention core the "attention" choice keeps or recomputes.
SDPA_OPS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable")}

MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
              torch.ops.aten.baddbmm.default}

KEEP, RECOMPUTE, CORE, SWIGLU, BLOCK = "keep", "recompute", "attention", "swiglu", "block"


class Regions:
    """Which part of one block the op now running belongs to: a stack that the submodules' forward hooks
    push and pop, read by the checkpoint policy."""

    def __init__(self, ops: tuple[str, ...], keep_residual: bool):
        self.ops, self.keep_residual, self.stack = frozenset(ops), keep_residual, [BLOCK]

    def enter(self, module, args):
        self.stack.append(RECOMPUTE)

    def become(self, region: str):
        def mark(module, args):
            self.stack[-1] = region
        return mark

    def leave(self, module, args, output):
        self.stack.pop()

    def policy(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        # Only an op that allocates its output is kept: keeping a view (linear's reshape of its input) or an
        # in-place result would keep alive the storage it aliases.
        return CheckpointPolicy.MUST_SAVE if self.keeps(op) and allocates(op) else CheckpointPolicy.PREFER_RECOMPUTE

    def keeps(self, op) -> bool:
        region = self.stack[-1]
        if region == KEEP:      # the matmul itself: not the copy a strided input (SP's gather) is made into
            return op in MATMUL_OPS
        if region == CORE:
            return op in SDPA_OPS and CORE not in self.ops
        if region == SWIGLU:
            return SWIGLU not in self.ops
        return region == BLOCK and self.keep_residual     # the residual adds between attention and MLP


def allocates(op) -> bool:
    """No output of `op` aliases an input (per its schema): not a view, not in place."""
    return all(r.alias_info is None for r in op._schema.returns)


def check_ops(ops) -> tuple[str, ...]:
    unknown = sorted(set(ops) - set(SELECTIVE_OPS))
    if unknown:
        raise ValueError(f"selective recompute ops {unknown} are not known; choose from {list(SELECTIVE_OPS)}")
    return tuple(ops)


def llama_parts(block: nn.Module) -> dict[str, nn.Module]:
    """The block's attention and MLP, each with its input and output projections; a missing one is an error
    naming what selective recompute looks for."""
    missing = [f"{part}.{name}" for part in INPUT_PROJECTIONS
               for name in (*INPUT_PROJECTIONS[part], OUTPUT_PROJECTIONS[part])
               if not isinstance(getattr(getattr(block, part, None), name, None), nn.Module)]
    if missing:
        raise ValueError(f"selective recompute knows Llama-shaped blocks (self_attn.q_proj/k_proj/v_proj/o_proj, "
                         f"mlp.gate_proj/up_proj/down_proj); {type(block).__name__} has no {', '.join(missing)}: "
                         "use activation_checkpointing.mode full")
    return {part: getattr(block, part) for part in INPUT_PROJECTIONS}


def tag(module: nn.Module, region: str, regions: Regions) -> None:
    """The module's forward runs in `region`; its other pre-hooks (tensor parallelism's all-gather into the
    attention and the MLP, registered before) run recomputed: never kept, so never a cached tensor the
    collective then writes into."""
    module.register_forward_pre_hook(regions.enter, prepend=True)
    module.register_forward_pre_hook(regions.become(region))
    module.register_forward_hook(regions.leave, always_call=True)


def tag_projection(linear: nn.Module, region: str, regions: Regions) -> None:
    """A projection's matmul output is kept; for a LoRA layer (peft's base_layer inside) only the base matmul's,
    the adapters' small matmuls are recomputed."""
    base = getattr(linear, "base_layer", None)
    if isinstance(base, nn.Module):
        tag(linear, RECOMPUTE, regions)
        linear = base
    tag(linear, region, regions)


def tag_block(block: nn.Module, ops: tuple[str, ...]) -> Regions:
    parts = llama_parts(block)
    output = parts[ATTENTION].o_proj
    keep_output = type(output) is nn.Linear        # no in-place reduction after its matmul
    regions = Regions(ops, keep_residual=not keep_output)
    for name, child in block.named_children():
        tag(child, {ATTENTION: CORE, MLP: SWIGLU}.get(name, RECOMPUTE), regions)
    for part, module in parts.items():
        for name in INPUT_PROJECTIONS[part]:
            tag_projection(getattr(module, name), KEEP, regions)
    tag(output, KEEP if keep_output else RECOMPUTE, regions)
    tag(parts[MLP].down_proj, RECOMPUTE, regions)
    return regions


def apply_selective_recompute(model: nn.Module, ops=SELECTIVE_OPS) -> int:
    """Checkpoint each transformer block with the policy above. Returns the count of blocks."""
    ops = check_ops(ops)
    blocks = transformer_blocks(model, "selective activation recompute")
    for block in blocks:
        regions = tag_block(block, ops)
        inner = block.forward
        contexts = functools.partial(create_selective_checkpoint_contexts, regions.policy)

        def forward(*args, _inner=inner, _regions=regions, _contexts=contexts, **kwargs):
            _regions.stack[:] = [BLOCK]
            if not torch.is_grad_enabled():  # eval / generation: nothing to save, nothing to recompute
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
        block.forward = forward
    return len(blocks)
