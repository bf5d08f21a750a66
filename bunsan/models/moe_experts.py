"""The routed experts of the MoE block (models/moe.py): E SwiGLU MLPs held as 3-D weights, one kernel for all.

Each weight is one [num_experts, out, in] tensor (nn.Linear's [out, in] per expert, as torchtitan's
GroupedExperts and transformers 5's packed experts hold them), so expert parallelism can shard dimension 0
and a rank keeps whole experts. w1 is the gate projection, w3 the up projection, w2 the down projection:
expert e maps x to w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x)).

The tokens come sorted by expert with a count per expert (models/moe_dispatch.py). Two kernels compute them:

  grouped_mm  torch._grouped_mm: one call per projection for all experts, the groups given by the cumulative
              counts (no host sync). It runs only for some device/dtype/width combinations (fp32 and bf16 on
              the CPU when rows are 16-byte multiples; bf16 on recent NVIDIA GPUs), so it is probed once per
              combination, forward and backward, and checked against plain matmuls
  loop        one F.linear per expert over its slice of the sorted tokens (reads the counts on the host)

Both give the same outputs and gradients; an expert that gets no tokens gets a zero gradient either way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bunsan.models.saving import swiglu

# (device type, device index, dtype, in width, out width) -> whether torch._grouped_mm runs there
_GROUPED_MM_RUNS: dict[tuple, bool] = {}


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward on the CPU
    (torch 2.13) rejects an expanded one (the stride-0 gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` in group g (between offsets g-1 and g) times w[g]^T, as F.linear does per group."""
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype, d_in: int, d_out: int) -> bool:
    """Whether torch._grouped_mm runs forward and backward for [*, d_in] x [E, d_out, d_in]^T here and agrees
    with per-group matmuls (an empty group included)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # with gradients even when first asked under no_grad or inference_mode: the answer is cached for training;
        # its own saved tensors kept from any saved-tensor hooks around the forward that asks (activation
        # checkpointing counts what a block saves, and a recomputed block asks no more)
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            # drawn by a CPU generator, the same numbers on any device; copied over once per combination
            g = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(3, d_in, generator=g).to(device, dtype).requires_grad_()   # host: probe set-up
            w = torch.randn(3, d_out, d_in, generator=g).to(device, dtype).requires_grad_()   # host: probe set-up
            offsets = torch.tensor([1, 1, 3], dtype=torch.int32, device=device)   # host: probe set-up
            y = _grouped_linear(x, w, offsets)
            gx, gw = torch.autograd.grad(y.float().square().sum(), (x, w))
            ref = torch.cat([F.linear(x[:1], w[0]), F.linear(x[1:], w[2])])
            rx, rw = torch.autograd.grad(ref.float().square().sum(), (x, w))
            y, ref = y.detach(), ref.detach()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    tol = 1e-4 if dtype == torch.float32 else 5e-2         # relative, against the same math per group

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        scale = float(want.abs().max())     # host: set-up, once per combination
        return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * scale + 1e-6)
    return close(y, ref) and close(gx, rx) and close(gw, rw)


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, d_in: int, d_out: int) -> bool:
    """Cached `_probe_grouped_mm`: the first call per (device, dtype, widths) runs a tiny product."""
    key = (device.type, device.index, dtype, d_in, d_out)
    if key not in _GROUPED_MM_RUNS:
        _GROUPED_MM_RUNS[key] = _probe_grouped_mm(device, dtype, d_in, d_out)
    return _GROUPED_MM_RUNS[key]


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs dim -> hidden -> dim, weights w1/w3 [E, hidden, dim] and w2 [E, dim, hidden]."""

    def __init__(self, num_experts: int, dim: int, hidden: int, kernel: str = "auto"):
        super().__init__()
        if kernel not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"expert kernel {kernel!r} is not one of ('auto', 'grouped_mm', 'loop')")
        self.num_experts, self.dim, self.hidden, self.kernel = num_experts, dim, hidden, kernel
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))   # default device: where the block is built
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))   # default device: where the block is built
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))   # default device: where the block is built

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        """Whether a forward on `x` takes the grouped_mm kernel; "grouped_mm" where it cannot run is an error."""
        if self.kernel == "loop":
            return False
        runs = (grouped_mm_runs(x.device, x.dtype, self.dim, self.hidden)
                and grouped_mm_runs(x.device, x.dtype, self.hidden, self.dim))
        if self.kernel == "grouped_mm" and not runs:
            raise RuntimeError(
                f"expert_kernel='grouped_mm' but torch._grouped_mm does not run on {x.device} for {x.dtype} with "
                f"widths {self.dim} and {self.hidden} (torch {torch.__version__}; the CPU kernel needs rows that "
                f"are multiples of 16 bytes, CUDA wants bf16 on sm90+); use expert_kernel='auto' or 'loop'")
        return runs

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim]: tokens sorted by expert, counts [E] of them per expert (summing to N) -> [N, dim]."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expert inputs must be [tokens, dim={self.dim}], got shape {tuple(x.shape)}")
        if counts.shape != (self.num_experts,):
            raise ValueError(f"counts must have one entry per expert ({self.num_experts},), got "
                             f"{tuple(counts.shape)}")
        w1, w3, w2 = self.w1.to(x.dtype), self.w3.to(x.dtype), self.w2.to(x.dtype)
        if self.uses_grouped_mm(x):
            offsets = counts.cumsum(0).to(torch.int32)
            return _grouped_linear(swiglu(_grouped_linear(x, w1, offsets), _grouped_linear(x, w3, offsets)),
                                   w2, offsets)
        sizes = counts.tolist()    # host: the loop slices the sorted tokens by each expert's count
        outs = [F.linear(swiglu(F.linear(xe, w1[e]), F.linear(xe, w3[e])), w2[e])
                for e, xe in enumerate(torch.split(x, sizes))]
        return torch.cat(outs)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        """normal(0, std) for w1/w3, normal(0, out_std or std) for w2 (the projection back into the residual)."""
        self.w1.normal_(0.0, std)
        self.w3.normal_(0.0, std)
        self.w2.normal_(0.0, std if out_std is None else out_std)
