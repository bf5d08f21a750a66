"""Cut a plain model into pipeline stages: which layers each rank holds, and the module that holds them.

A model is seen as an ordered list of layers, each a group of module paths:

    Llama:        [embed_tokens] [layers.0] ... [layers.L-1] [norm, lm_head]
    nn.Sequential: [0] [1] ... [n-1]

The list is cut into p x v contiguous chunks (p ranks, v virtual chunks each; chunk
c of rank r is global stage c*p + r). A rank's StageModule re-creates, under the
same paths, only the modules it holds, so parameter names (and tensor-parallel
plans, checkpoints, ZeRO) see the original names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

PARTITIONS = ("uniform", "parameters", "balanced")


@dataclass(frozen=True)
class Layer:
    paths: tuple[str, ...]   # module paths in the original model, run in this order
    params: int              # parameters (tied ones counted where they appear)
    cost: int                # matmul parameters: embedding lookups cost ~nothing
    repeated: bool           # a transformer block (what "uniform" counts)


def _numel(mods: list[nn.Module], skip_embedding: bool) -> int:
    seen, n = set(), 0
    for m in mods:
        for sub in m.modules():
            if skip_embedding and isinstance(sub, nn.Embedding):
                continue
            for p in sub.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
    return n


def is_llama(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in ("embed_tokens", "layers", "norm", "lm_head", "rope_cos"))


def model_layers(model: nn.Module) -> list[Layer]:
    """The ordered layers of a bunsan Llama (or a Llama-shaped model) or of an nn.Sequential."""
    if is_llama(model):
        groups = [("embed_tokens",)] + [(f"layers.{i}",) for i in range(len(model.layers))] + [("norm", "lm_head")]
    elif isinstance(model, nn.Sequential):
        groups = [(name,) for name, _ in model.named_children()]
    else:
        raise ValueError(f"pipeline parallelism cuts a model into an ordered list of layers; {type(model).__name__} "
                         "is neither a bunsan Llama nor an nn.Sequential. Wrap its layers in an nn.Sequential "
                         "(each taking and returning one tensor) or set pipeline.stages to 1")
    out = []
    for paths in groups:
        mods = [model.get_submodule(p) for p in paths]
        repeated = is_llama(model) and paths[0].startswith("layers.") or not is_llama(model)
        out.append(Layer(paths, _numel(mods, False), _numel(mods, True), repeated))
    return out


def _min_max_cut(weights: list[int], parts: int) -> list[int]:
    """Contiguous split of `weights` into `parts` non-empty runs minimising the heaviest run: run sizes."""
    n = len(weights)
    inf = float("inf")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the smallest possible heaviest run cutting the first i layers into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cand = max(best[k - 1][j], prefix[i] - prefix[j])
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def partition(layers: list[Layer], chunks: int, method: str = "uniform") -> list[list[int]]:
    """Layer indices of each of `chunks` global stages, contiguous and in order."""
    if method not in PARTITIONS:
        raise ValueError(f"pipeline.partition {method!r} is unknown; use one of {', '.join(PARTITIONS)}")
    if chunks > len(layers):
        raise ValueError(f"the model has {len(layers)} pipeline layers, fewer than the {chunks} stages asked for "
                         "(pipeline.stages x virtual_stages); lower them to at most the layer count")
    if method == "uniform":
        # Megatron's rule: blocks divided evenly, the extra ones to the first stages; the other layers
        # (embedding, head) ride with the first and last stage.
        blocks = [i for i, layer in enumerate(layers) if layer.repeated]
        if len(blocks) < chunks:
            raise ValueError(f"uniform partition needs at least one transformer block per stage: {len(blocks)} "
                             f"blocks for {chunks} stages; use fewer stages or partition 'parameters'")
        base, extra = divmod(len(blocks), chunks)
        sizes = [base + (1 if c < extra else 0) for c in range(chunks)]
        out, pos = [], 0
        for c, size in enumerate(sizes):
            out.append(blocks[pos:pos + size])
            pos += size
        out[0] = list(range(0, out[0][-1] + 1))
        out[-1] = list(range(out[-1][0], len(layers)))
        return out
    weights = [layer.params if method == "parameters" else layer.cost for layer in layers]
    sizes = _min_max_cut([max(w, 1) for w in weights], chunks)
    out, pos = [], 0
    for size in sizes:
        out.append(list(range(pos, pos + size)))
        pos += size
    return out


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put `module` at `path` under `root`, creating containers on the way (ModuleDict for numeric keys)."""
    parts = path.split(".")
    node = root
    for part in parts[:-1]:
        child = node._modules.get(part)
        if child is None:
            child = nn.ModuleDict()
            node.add_module(part, child)
        node = child
    node.add_module(parts[-1], module)


class StageModule(nn.Module):
    """The modules of one rank's pipeline chunks, under their original paths.

    `chunks[c]` lists the layers (tuples of paths) of this rank's chunk c, in order;
    `run(c, x, seq_len)` runs them. Llama blocks get the rope tables, held here as
    non-persistent buffers like the model's own.
    """

    def __init__(self, model: nn.Module, chunks: list[list[Layer]], stage_ids: list[int], n_stages: int):
        super().__init__()
        self.llama = is_llama(model)
        self.config = getattr(model, "config", None)
        self.chunk_layers = [[layer.paths for layer in chunk] for chunk in chunks]
        self.stage_ids, self.n_stages = stage_ids, n_stages
        for chunk in chunks:
            for layer in chunk:
                for path in layer.paths:
                    _attach(self, path, model.get_submodule(path))
        if self.llama:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self._init_parameter = getattr(model, "init_parameter", None)
        self._init_buffer = getattr(model, "init_buffer", None)      # (name, tensor): buffers drawn by name
        self._init_weights = getattr(model, "init_weights", None)
        self._source = type(model).__name__

    def holds(self, path: str) -> bool:
        try:
            self.get_submodule(path)
            return True
        except AttributeError:
            return False

    def run(self, c: int, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        for paths in self.chunk_layers[c]:
            if self.llama and paths[0].startswith("layers."):
                x = self.get_submodule(paths[0])(x, self.rope_cos[:seq_len], self.rope_sin[:seq_len])
            else:
                for path in paths:
                    x = self.get_submodule(path)(x)
        return x

    def init_buffers(self) -> None:
        if self._init_buffer is not None:
            with torch.no_grad():
                for name, b in self.named_buffers():
                    self._init_buffer(name, b)
        if self.llama and self.config is not None:
            from bunsan.models.llama import rope_tables
            cos, sin = rope_tables(self.config, device=self.rope_cos.device)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.dtype), sin.to(self.rope_sin.dtype)
