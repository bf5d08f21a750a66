"""A model served on the CPU runs its linear layers from weights laid out once in oneDNN's blocked format
(the prepacked GEMM PyTorch's inductor uses on the CPU after freezing), instead of nn.Linear's MKL GEMM,
which packs the weight again on every call: a 64-row decode step of bench_serve's model spends ~10-15% less
time (benchmarks/RESULTS.md). The results differ from nn.Linear's by rounding only (a few 1e-6 of the
logits in fp32), as two GEMM libraries do.

Each packed layer keeps its weight's shape and dtype on the meta device (its memory freed: the packed copy is
what runs), or the weight itself where another module shares it (a head tied to the embedding), so what
reports the model's parameters (/api/show, /api/ps) reads the same. fp32 and bf16 only;
a layer whose packed output does not match nn.Linear's on a probe stays as it was.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, rows: int, shared: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, rows), persistent=False)
        self.bias = linear.bias
        self.weight = linear.weight if shared else \
            nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packable(model: nn.Module) -> bool:
    """Every weight on the CPU in fp32 or bf16, and oneDNN's packed GEMM in this torch."""
    params = list(model.parameters())
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(params) and all(p.device.type == "cpu" and p.dtype in TOLERANCE for p in params))


def pack_linears(model: nn.Module, rows: int) -> int:
    """Swap every nn.Linear of `model` for a PackedLinear laid out for `rows` rows a call; how many were."""
    owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    done = 0
    with torch.no_grad():
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is not nn.Linear:
                    continue
                packed = PackedLinear(child, rows, shared=owners[id(child.weight)] > 1)
                probe = torch.randn(3, child.in_features, generator=torch.Generator().manual_seed(0)).to(
                    child.weight.dtype)
                rtol, atol = TOLERANCE[child.weight.dtype]
                if torch.allclose(packed(probe), F.linear(probe, child.weight, child.bias), rtol=rtol, atol=atol):
                    setattr(module, name, packed)
                    done += 1
    return done
