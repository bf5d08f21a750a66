"""Hugging Face decoder blocks at the activation bound: their RMSNorms and gated MLPs run bunsan's saving forms
(models/saving.py), as bunsan's own Llama does.

transformers' eager RMSNorm keeps what autograd saves along its way (the fp32 upcast of the input, its
normalised copy, the cast back), and its MLP keeps act(gate) beside gate and up: 1.3-1.5x the bytes per
token the backward needs. The saving forms run the same forward op for op and, in backward, eager autograd's
own steps in its order, so both are the eager ones bit for bit; they keep only the norm's input with its
per-token rstd, and the MLP's gate and up. A module is swapped only where its forward is transformers' code
itself (the code object of Llama's RMSNorm and MLP, which Qwen2, Qwen3, Mistral and others copy, or of
Gemma's (1 + weight) RMSNorm), never by name alone, and an MLP only with SiLU or tanh-GELU (Gemma's); any
other keeps its forward. The parameters, their names and the state dict are untouched.
"""

from __future__ import annotations

import functools
import types

import torch.nn as nn
import torch.nn.functional as F

from bunsan.models.saving import geglu, offset_rms_norm, rms_norm, swiglu


def _same_code(a, b) -> bool:
    ca, cb = a.__code__, b.__code__
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)


def _norm_forward(self, hidden_states):
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _offset_norm_forward(self, x):
    return offset_rms_norm(x, self.weight, self.eps)


def _mlp_forward(self, x):
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _gelu_mlp_forward(self, x):
    return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


def _activation(act) -> str | None:
    """"silu" or "gelu_tanh" for transformers' (or torch's) modules of exactly those; None for any other."""
    if isinstance(act, nn.SiLU) or (type(act).__name__ == "SiLUActivation" and
                                   "silu" in type(act).forward.__code__.co_names):
        return "silu"
    fn = getattr(act, "act", None)
    if type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial) and fn.func is F.gelu and \
            fn.keywords == {"approximate": "tanh"} and not fn.args:
        return "gelu_tanh"
    return None


def apply_saving_forms(model: nn.Module) -> dict[str, int]:
    """Swap the forwards of `model`'s Llama- and Gemma-form RMSNorms and SiLU / tanh-GELU gated MLPs for the
    saving forms; how many of each."""
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return {"norms": 0, "mlps": 0}       # (and transformers' modeling code is never imported for it)
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    except ImportError:
        return {"norms": 0, "mlps": 0}
    swapped = {"norms": 0, "mlps": 0}
    mlp_forms = {"silu": _mlp_forward, "gelu_tanh": _gelu_mlp_forward}
    for module in model.modules():
        forward = type(module).forward
        if not isinstance(getattr(module, "weight", None), nn.Parameter) and not hasattr(module, "act_fn"):
            continue
        if _same_code(forward, LlamaRMSNorm.forward):
            module.forward, kind = types.MethodType(_norm_forward, module), "norms"
        elif _same_code(forward, GemmaRMSNorm.forward) and _same_code(module._norm, GemmaRMSNorm._norm):
            module.forward, kind = types.MethodType(_offset_norm_forward, module), "norms"
        elif _same_code(forward, LlamaMLP.forward) and _activation(getattr(module, "act_fn", None)):
            module.forward, kind = types.MethodType(mlp_forms[_activation(module.act_fn)], module), "mlps"
        else:
            continue
        swapped[kind] += 1
    return swapped
