"""A model served on the CPU runs its linear layers from weights laid out once in oneDNN's blocked format
(the prepacked GEMM PyTorch's inductor uses on the CPU after freezing), instead of nn.Linear's MKL GEMM,
which packs the weight again on every call: a 64-row decode step of bench_serve's model spends ~10-15% less
time (benchmarks/RESULTS.md). The results differ from nn.Linear's by rounding only (a few 1e-6 of the
logits in fp32), as two GEMM libraries do.

Sibling layers that read the same input (an attention's q/k/v_proj, an MLP's gate/up_proj: GROUPS) run as one
GEMM on their weights side by side, as vLLM's QKVParallelLinear and MergedColumnParallelLinear do: one call
where there were three (or two), on a wider weight. The first member called computes every member's columns;
the others take theirs while their input is the same tensor, unchanged. A member called on another input (a
model whose k/v read other states) computes the group again for that input, so any calling order gets its own
layer's output.

Each packed layer keeps its weight's shape and dtype on the meta device (its memory freed: the packed copy is
what runs), or the weight itself where another module shares it (a head tied to the embedding), so what
reports the model's parameters (/api/show, /api/ps) reads the same. fp32 and bf16 only;
a layer whose packed output does not match nn.Linear's on a probe stays as it was.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate

import torch
import torch.nn as nn
import torch.nn.functional as F

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
# Children of one module, by name, that the transformers causal LMs bunsan serves call on the same input
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _packed_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _reported_weight(linear: nn.Linear, shared: bool) -> nn.Parameter:
    """What the packed layer shows as its weight: the weight itself where another module holds it too, else
    its shape and dtype on the meta device (the packed copy is what runs)."""
    weight = linear.weight
    return weight if shared else nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                              requires_grad=False)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, rows: int, shared: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows),
                             persistent=False)
        self.bias = linear.bias
        self.weight = _reported_weight(linear, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_gemm(x, self.packed, self.bias)


class PackedGroup:
    """The one GEMM of sibling linears (GROUPS) and its last output, which each member takes its columns of."""

    def __init__(self, linears: list[nn.Linear], rows: int):
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        self.bias = None
        if any(linear.bias is not None for linear in linears):
            self.bias = torch.cat([linear.bias.detach() if linear.bias is not None else
                                   weight.new_zeros(linear.out_features) for linear in linears])
        ends = list(accumulate(linear.out_features for linear in linears))
        self.columns = [slice(start, end) for start, end in zip([0] + ends[:-1], ends)]
        self._input: torch.Tensor | None = None     # what the held output was computed from, and its version
        self._version = -1
        self._output: torch.Tensor | None = None
        self._taken: set[int] = set()               # the members that took their columns of it

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or x._version != self._version or member in self._taken:
            self._output = _packed_gemm(x, self.packed, self.bias)
            self._input, self._version, self._taken = x, x._version, set()
        self._taken.add(member)
        out = self._output[..., self.columns[member]]
        if len(self._taken) == len(self.columns):      # every member served: hold nothing until the next input
            self._input = self._output = None
        return out


class PackedGroupMember(nn.Module):
    def __init__(self, linear: nn.Linear, group: PackedGroup, member: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.member = group, member          # (a plain object: not a submodule, nothing counted)
        self.bias = linear.bias
        self.weight = _reported_weight(linear, shared=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.member, x)


def packable(model: nn.Module) -> bool:
    """Every weight on the CPU in fp32 or bf16, and oneDNN's packed GEMM in this torch."""
    params = list(model.parameters())
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and bool(params) and all(p.device.type == "cpu" and p.dtype in TOLERANCE for p in params))


def _agrees(packed: list[nn.Module], linears: list[nn.Linear]) -> bool:
    """Each packed layer's output on one probe input (called in turn, as a layer's siblings are) against
    nn.Linear's."""
    linear = linears[0]
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(linear.weight.dtype)
    rtol, atol = TOLERANCE[linear.weight.dtype]
    return all(torch.allclose(p(probe), F.linear(probe, lin.weight, lin.bias), rtol=rtol, atol=atol)
               for p, lin in zip(packed, linears))


def _sibling_groups(module: nn.Module, owners: Counter) -> list[list[str]]:
    """The GROUPS among `module`'s children: every member a plain nn.Linear with a weight of its own, all of
    one input width and dtype."""
    children = dict(module.named_children())
    found = []
    for names in GROUPS:
        linears = [children.get(name) for name in names]
        if all(type(lin) is nn.Linear and owners[id(lin.weight)] == 1 for lin in linears) and \
                len({(lin.in_features, lin.weight.dtype) for lin in linears}) == 1:
            found.append(list(names))
    return found


def pack_linears(model: nn.Module, rows: int) -> int:
    """Swap every nn.Linear of `model` for a packed layer laid out for `rows` rows a call, the GROUPS among
    siblings sharing one GEMM; how many were."""
    owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    done = 0
    with torch.no_grad():
        for module in list(model.modules()):
            for names in _sibling_groups(module, owners):
                linears = [getattr(module, name) for name in names]
                group = PackedGroup(linears, rows)
                members = [PackedGroupMember(lin, group, i) for i, lin in enumerate(linears)]
                if _agrees(members, linears):
                    for name, member in zip(names, members):
                        setattr(module, name, member)
                    done += len(members)
            for name, child in list(module.named_children()):
                if type(child) is not nn.Linear:
                    continue
                packed = PackedLinear(child, rows, shared=owners[id(child.weight)] > 1)
                if _agrees([packed], [child]):
                    setattr(module, name, packed)
                    done += 1
    return done
