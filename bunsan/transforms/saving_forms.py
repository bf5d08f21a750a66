"""Hugging Face decoder blocks at the activation bound: their RMSNorms and SiLU-gated MLPs run bunsan's saving
forms (models/saving.py), as bunsan's own Llama does.

transformers' eager RMSNorm keeps what autograd saves along its way (the fp32 upcast of the input, its
normalised copy, the cast back), and its MLP keeps silu(gate) beside gate and up: 1.3-1.5x the bytes per
token the backward needs. The saving forms compute the same forward, op for op (so the same values, bit for
bit), and keep only the norm's input with its per-token rstd, and the MLP's gate and up; their backward is
the analytic one bunsan's Llama uses. A module is swapped only where its forward is transformers' Llama
code itself (the code object: Qwen2, Qwen3, Mistral and the other copies of it), never by name alone;
Gemma's (1 + weight) norm and other activations keep their own forward. The parameters, their names and the
state dict are untouched.
"""

from __future__ import annotations

import types

import torch.nn as nn

from bunsan.models.saving import rms_norm, swiglu


def _same_code(a, b) -> bool:
    ca, cb = a.__code__, b.__code__
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)


def _norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    forward = getattr(type(act), "forward", None)
    return type(act).__name__ == "SiLUActivation" and forward is not None and "silu" in forward.__code__.co_names


def apply_saving_forms(model: nn.Module) -> dict[str, int]:
    """Swap the forwards of `model`'s Llama-form RMSNorms and SiLU MLPs for the saving forms; how many of each."""
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    except ImportError:
        return {"norms": 0, "mlps": 0}
    swapped = {"norms": 0, "mlps": 0}
    for module in model.modules():
        forward = type(module).forward
        if _same_code(forward, LlamaRMSNorm.forward) and isinstance(getattr(module, "weight", None), nn.Parameter):
            module.forward = types.MethodType(_norm_forward, module)
            swapped["norms"] += 1
        elif _same_code(forward, LlamaMLP.forward) and _is_silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_mlp_forward, module)
            swapped["mlps"] += 1
    return swapped

