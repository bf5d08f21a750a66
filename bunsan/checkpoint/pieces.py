"""What one rank holds of every logical tensor, in coordinates any other layout can read.

A logical tensor is (name, kind): the plain model's parameter name (tied weights under their first
name) and `master` (fp32 weights), an optimizer state (`exp_avg`, ...), or `frozen` (a weight
nothing trains). A rank holds a *local* tensor: the whole parameter, or its tensor-parallel slice
along `tp_dim` starting at global index `start` (vocabulary slices are padded at the end). Of that
local tensor, flattened, it steps the elements [lo, hi): ZeRO's fragments, or all of it.

A piece records exactly that: name, kind, global shape, local shape, tp_dim, start, [lo, hi). A fused
projection's slice (layers.split_sections; a transformers MoE's gate and up packed along dim 1) records its
`sections` too: the global tensor is that many equal blocks along tp_dim, and the local tensor holds rows
[start, start + rows) of each; `viewed` places it as a plain slice of the global tensor viewed with the blocks as
a dimension of their own. Under expert and tensor parallelism at once an expert weight is cut twice: its run of
whole experts along dim 0 from `expert_start`, and its tensor-parallel slice along tp_dim (>= 1).
Writers are chosen so every element is written once: data-parallel replicas (stage 0) write from
dp rank 0, tensor-parallel replicas (norms) from tp rank 0, a weight tied across pipeline stages
from the stage that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.expert_parallel import global_expert_names
from bunsan.tensor_parallel.plan import tp_sections_of


@dataclass(frozen=True)
class Local:
    """A rank's local tensor of one parameter, placed in the global tensor."""
    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    tp_dim: int | None = None
    start: int = 0
    sections: int = 1
    expert_start: int | None = None     # expert x tensor parallelism: the first expert (dim 0) held here

    @property
    def valid(self) -> int:
        """Rows along tp_dim that are real (the rest is vocabulary padding); of each section's."""
        if self.tp_dim is None:
            return self.local_shape[0] if self.local_shape else 1
        k = self.sections
        return max(0, min(self.local_shape[self.tp_dim] // k, self.global_shape[self.tp_dim] // k - self.start))

    def viewed(self, sections: int, dim: int) -> Local:
        """The same elements with the global tensor's `dim` (a fused projection's rows) as [sections, rows /
        sections]: a whole tensor stays whole, a sectioned slice becomes a plain slice along dim + 1."""
        def split(shape):
            return (*shape[:dim], sections, shape[dim] // sections, *shape[dim + 1:])
        if self.tp_dim is None:
            return Local(self.name, split(self.global_shape), split(self.local_shape))
        if self.sections != sections or self.tp_dim != dim or (dim == 0 and self.expert_start is not None):
            raise ValueError(f"{self.name}: a slice along dim {self.tp_dim} in {self.sections} section(s) has no "
                             f"view as {sections} sections along dim {dim}")
        return Local(self.name, split(self.global_shape), split(self.local_shape), dim + 1, self.start,
                     expert_start=self.expert_start)

    def region(self) -> list[tuple[int, int]]:
        """Global [lo, hi) per dimension of the local tensor's real part (a sectioned slice: of its view)."""
        if self.sections > 1:
            return self.viewed(self.sections, self.tp_dim).region()
        out = [(0, n) for n in self.global_shape]
        if self.tp_dim is not None:
            out[self.tp_dim] = (self.start, self.start + self.valid)
        if self.expert_start is not None:
            out[0] = (self.expert_start, self.expert_start + self.local_shape[0])
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.global_shape), "local_shape": list(self.local_shape),
                "tp_dim": self.tp_dim, "start": self.start, **({"sections": self.sections} if self.sections > 1
                                                                else {}),
                **({"expert_start": self.expert_start} if self.expert_start is not None else {})}

    @classmethod
    def from_json(cls, d: dict) -> Local:
        return cls(d["name"], tuple(d["shape"]), tuple(d["local_shape"]), d["tp_dim"], d["start"],
                   d.get("sections", 1), d.get("expert_start"))


def _tp_place(module: nn.Module, param: torch.Tensor, local_shape: tuple,
              tp_rank: int) -> tuple[tuple[int, ...], int | None, int, int, int | None]:
    """(global shape, tp_dim, start, sections, expert_start) of a parameter of `module` whose local shape is
    `local_shape`."""
    attr = next((n for n, q in module._parameters.items() if q is param), None)
    split = getattr(module, "tp_split", {}).get(attr)
    experts = getattr(module, "ep_split", {}).get(attr)    # expert parallelism: a run of whole experts (dim 0)
    if experts is not None and split is None:
        return tuple(experts), 0, module.first, 1, None
    if split is None:
        return tuple(local_shape), None, 0, 1, None
    full_shape, dim = split           # (tensor parallelism cut first: its full shape has every expert)
    sections = tp_sections_of(module, attr)
    expert_start = module.first if experts is not None else None
    return tuple(full_shape), dim, tp_rank * local_shape[dim] // sections, sections, expert_start


def locals_of(engine) -> tuple[list[Local], list[bool]]:
    """The Local of every parameter the strategy steps (strategy order) and whether this rank writes it."""
    module, pipe, mesh = engine.module, engine.pipe, engine.mesh
    canonical = dict(pipe.canonical) if pipe is not None else {}
    if engine.ep is not None:       # a layer holding its own experts numbers them per rank: saved by global index
        canonical.update({k: v[engine.ep.group.rank] for k, v in global_expert_names(module, engine.ep).items()})
    duplicates = pipe.duplicates if pipe is not None else set()
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    shapes = engine.strategy.param_shapes   # (ZeRO-3's released parameters are empty: the strategy keeps the shapes)
    out, writes = [], []
    for i, p in enumerate(engine.strategy.params):
        name = names[id(p)]
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        local_shape = tuple(shapes[i])
        shape, dim, start, sections, expert_start = _tp_place(owner, p, local_shape, mesh.tp_rank)
        out.append(Local(canonical.get(name, name), shape, local_shape, dim, start, sections, expert_start))
        replicated_tp = dim is None and mesh.tp > 1
        writes.append(name not in duplicates and not (replicated_tp and mesh.tp_rank != 0))
    return out, writes


def frozen_of(engine) -> list[tuple[Local, int, torch.Tensor, bool]]:
    """Parameters nothing trains (and persistent buffers): (Local, first element, this rank's flat part of it,
    this rank writes it). Whole tensors from dp rank 0, or under ZeRO-3 (frozen weights sharded) each rank's
    fragments."""
    module, mesh = engine.module, engine.mesh
    trained = {id(p) for p in engine.strategy.params}
    canonical = engine.pipe.canonical if engine.pipe is not None else {}
    sharded = engine.strategy.frozen_shards
    duplicates = engine.pipe.duplicates if engine.pipe is not None else set()   # tied across stages: once
    out, seen = [], set()

    def local(name, p, shape):
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        full, dim, start, sections, expert_start = _tp_place(owner, p, shape, mesh.tp_rank)
        return Local(canonical.get(name, name), full, shape, dim, start, sections, expert_start)

    if sharded is not None:
        for i, lo, part in sharded.fragments():
            t = local(sharded.names[i], sharded.params[i], sharded.shapes[i])
            out.append((t, lo, part, (t.tp_dim is not None or mesh.tp_rank == 0)
                        and sharded.names[i] not in duplicates))
        seen = {id(p) for p in sharded.params}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in trained or id(p) in seen:
            continue
        seen.add(id(p))
        t = local(name, p, tuple(p.shape))
        writes = mesh.grad_group.rank == 0 and (t.tp_dim is not None or mesh.tp_rank == 0) \
            and name not in duplicates
        out.append((t, 0, p.data.view(-1), writes))
    persistent = set(module.state_dict().keys())
    for name, b in module.named_buffers():
        if name in persistent and b is not None:
            writes = mesh.grad_group.rank == 0 and mesh.tp_rank == 0
            out.append((Local(name, tuple(b.shape), tuple(b.shape)), 0, b.view(-1), writes))
    return out
