"""Autograd functions that save only what their backward needs, where torch has no fused op that does.

  rms_norm  saves its 16-bit input and the fp32 per-token rstd; autograd through the eager form keeps the
            fp32 copy of the input and the normalised fp32 tensor too (F.rms_norm on CPU is that same
            composite). The forward is HF's, exactly: normalise in fp32, cast back, then scale; the backward
            recomputes the fp32 input and runs eager autograd's steps in its order, so both are the eager
            ones bit for bit. offset_rms_norm is Gemma's form (scale by 1 + weight in fp32, then cast).
  swiglu    silu(gate) * up saves gate and up; autograd through the eager form also keeps silu(gate). The
            backward runs the same kernels eager autograd runs (silu_backward, mul), so gradients are
            the eager ones bit for bit. geglu is Gemma's gelu_tanh(gate) * up, alike.

Bytes per token (16-bit): rms_norm 2h + 4 instead of 8h + 4; swiglu 4i instead of 6i (the product, which
down_proj saves as its input, is counted there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rstd_backward(gn: torch.Tensor, xf: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d(xf) of n = xf * rstd(xf), from gn = d(n) in fp32: eager autograd's own steps, in its order (mul,
    rsqrt, mean and pow backward), so the gradient is the eager one bit for bit."""
    direct = gn * rstd
    g_rstd = (gn * xf).sum(-1, keepdim=True)
    g_var = -0.5 * g_rstd * rstd.pow(3)
    g_square = g_var.expand_as(xf) / xf.shape[-1]
    return direct + g_square * (2 * xf)


class RMSNormFunction(torch.autograd.Function):
    """Llama's norm: weight * (x normalised in fp32).to(x's dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        # normalise the fp32 copy in place when it is one (16-bit input): no second fp32 tensor, in
        # generation's forward either (the inference estimator's one-step peak)
        normed = xf.mul_(rstd) if xf is not x else xf * rstd
        del xf
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - 1))
            grad_weight = (grad * (xf * rstd).to(x.dtype)).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _rstd_backward((grad * weight).float(), xf, rstd).to(x.dtype)
        return grad_x, grad_weight, None


class OffsetRMSNormFunction(torch.autograd.Function):
    """Gemma's norm: (x normalised in fp32 * (1 + weight in fp32)).to(x's dtype)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * (1.0 + weight.float())).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xf, gf = x.float(), grad.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - 1))
            grad_weight = (gf * (xf * rstd)).sum(dims).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _rstd_backward(gf * (1.0 + weight.float()), xf, rstd).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not torch.is_grad_enabled():       # generation: the same ops, without an autograd Function's dispatch
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        normed = xf.mul_(rstd) if xf is not x else xf * rstd      # (in place on a 16-bit input's fp32 copy)
        return weight * normed.to(x.dtype)
    return RMSNormFunction.apply(x, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return OffsetRMSNormFunction.apply(x, weight, eps)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)


class GeGLUFunction(torch.autograd.Function):
    """gelu_tanh(gate) * up (Gemma's MLP), saving gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = grad * F.gelu(gate, approximate="tanh") if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh") \
            if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return GeGLUFunction.apply(gate, up)
