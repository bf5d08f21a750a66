"""Two autograd functions that save only what their backward needs, where torch has no fused op that does.

  rms_norm  saves its 16-bit input and the fp32 per-token rstd; autograd through the eager form keeps the
            fp32 copy of the input and the normalised fp32 tensor too (F.rms_norm on CPU is that same
            composite). The forward is HF's, exactly: normalise in fp32, cast back, then scale.
  swiglu    silu(gate) * up saves gate and up; autograd through the eager form also keeps silu(gate). The
            backward runs the same kernels eager autograd runs (silu_backward, mul), so gradients are
            the eager ones bit for bit.

Bytes per token (16-bit): rms_norm 2h + 4 instead of 8h + 4; swiglu 4i instead of 6i (the product, which
down_proj saves as its input, is counted there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNormFunction(torch.autograd.Function):
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
        normed_f = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad.dim() - 1))
            grad_weight = (grad * normed_f.to(x.dtype)).sum(dims).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).float()   # through the cast back to x's dtype: the gradient in fp32
            grad_x = (rstd * (g - normed_f * (g * normed_f).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


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
