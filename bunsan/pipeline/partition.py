"""Cut a plain model into pipeline stages: which layers each rank holds, and the module that holds them.

A model is seen as an ordered list of layers, each a group of module paths:

    Llama:        [embed_tokens] [layers.0] ... [layers.L-1] [norm, lm_head]
    Hugging Face: [model.embed_tokens] [model.layers.0] ... [model.norm, lm_head]   (a decoder-only LM)
    multimodal:   [model.vision_tower, model.multi_modal_projector, model.language_model.embed_tokens]
                  [model.language_model.layers.0] ... [model.language_model.norm, lm_head]   (LLaVA, Qwen2-VL)
    nn.Sequential: [0] [1] ... [n-1]

The list is cut into p x v contiguous chunks (p ranks, v virtual chunks each; chunk
c of rank r is global stage c*p + r). A rank's StageModule re-creates, under the
same paths, only the modules it holds, so parameter names (and tensor-parallel
plans, checkpoints, ZeRO) see the original names.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.models.hf_layout import encoder_paths, hf_composite_base, hf_decoder_prefix

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
    hf = hf_decoder_prefix(model)
    if is_llama(model):
        groups = [("embed_tokens",)] + [(f"layers.{i}",) for i in range(len(model.layers))] + [("norm", "lm_head")]
    elif hf is not None:
        blocks = model.get_submodule(hf).layers
        groups = [(*encoder_paths(model), f"{hf}.embed_tokens")] + \
            [(f"{hf}.layers.{i}",) for i in range(len(blocks))] + [(f"{hf}.norm", "lm_head")]
    elif isinstance(model, nn.Sequential):
        groups = [(name,) for name, _ in model.named_children()]
    else:
        raise ValueError(f"pipeline parallelism cuts a model into an ordered list of layers; {type(model).__name__} "
                         "is neither a bunsan Llama, a Hugging Face decoder-only LM (embed_tokens, layers, norm, "
                         "rotary_emb, lm_head) nor an nn.Sequential. Wrap its layers in an nn.Sequential (each "
                         "taking and returning one tensor) or set pipeline.stages to 1")
    out = []
    for paths in groups:
        mods = [model.get_submodule(p) for p in paths]
        repeated = ".layers." in f".{paths[-1]}" if is_llama(model) or hf is not None else True
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
        self.architecture = type(model).__name__     # what a checkpoint records the model as (not this stage)
        # a transformers model's block classes: its stage's blocks are then found as the whole model's are
        # (models/blocks.py), so that recompute wraps them and ZeRO-3 gathers them one by one (without it a
        # stage had no blocks: recompute was skipped and the stage was gathered whole)
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        self.chunk_layers = [[layer.paths for layer in chunk] for chunk in chunks]
        self.stage_ids, self.n_stages = stage_ids, n_stages
        for chunk in chunks:
            for layer in chunk:
                for path in layer.paths:
                    _attach(self, path, model.get_submodule(path))
        if self.llama:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.hf_prefix, self.hf_composite = hf_decoder_prefix(model), hf_composite_base(model)
        self.keyword_inputs = None    # a Hugging Face decoder's stages take these batch keys (engine/batch.py)
        if self.hf_prefix is not None:
            self.keyword_inputs = HF_STAGE_INPUTS
            object.__setattr__(self, "_hf_views", _hf_views(self, model, self.hf_prefix, chunks, n_stages,
                                                            stage_ids))
        if self.hf_composite is not None:     # every key the model's forward takes reaches the stages
            self.keyword_inputs = tuple(composite_inputs(model))
            outer = copy.copy(model.get_submodule(self.hf_composite))
            outer.__dict__["_modules"] = {}                      # the stage's, at each run
            object.__setattr__(self, "_outer", outer)
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

    def run(self, c: int, x: torch.Tensor, seq_len: int, mb=None) -> torch.Tensor:
        if self.hf_prefix is not None:
            return _run_hf(self, c, x, mb)
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


# -- Hugging Face decoders: each chunk runs the model's own base forward over the layers it holds -----------
HF_STAGE_INPUTS = ("input_ids", "attention_mask", "position_ids")   # what every stage is given of a batch
_IDENTITY = nn.Identity()     # the final norm of a chunk that is not the last


def _hf_views(stage: StageModule, model: nn.Module, prefix: str, chunks: list[list[Layer]], n_stages: int,
              stage_ids: list[int]) -> list[tuple[nn.Module, list[str], bool, bool]]:
    """Per chunk: (a shallow copy of the base model, the paths of the chunk's decoder layers, first stage?,
    last stage?).

    The base model's forward then builds the causal mask (and sliding windows) and the rotary embeddings
    for the chunk from its input, as it does for the whole model; a chunk after the first is fed the
    hidden states as inputs_embeds, and only the last one applies the final norm (and, beside it, the head).
    """
    base = model.get_submodule(prefix)
    extra = [n for n, m in base.named_children() if n not in ("embed_tokens", "layers", "norm", "rotary_emb")
             and any(True for _ in m.parameters())]
    if extra:
        raise ValueError(f"pipeline parallelism of {type(model).__name__}: its base model also holds {extra} with "
                         "parameters, which no pipeline layer owns; set pipeline.stages to 1")
    _attach(stage, f"{prefix}.rotary_emb", base.rotary_emb)   # every stage computes its positions
    views = []
    for chunk, sid in zip(chunks, stage_ids):
        view = copy.copy(base)
        view.__dict__["_modules"] = {"rotary_emb": base.rotary_emb}   # the rest: the stage's, at each run
        blocks = [p for layer in chunk for p in layer.paths if p.startswith(f"{prefix}.layers.")]
        indices = [int(p.rsplit(".", 1)[1]) for p in blocks]   # host: layer numbers parsed from paths, no tensor
        view.__dict__["config"] = _chunk_config(base.config, indices)
        views.append((view, blocks, sid == 0, sid == n_stages - 1))
    return views


def _chunk_config(config, layers: list[int]):
    """The base model's config as a chunk's forward must read it: its loop counts and indexes per-layer
    settings (Qwen2's and Gemma's `layer_types`: full or sliding-window attention) by position in the chunk."""
    mine = copy.copy(config)
    mine.num_hidden_layers = len(layers)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        mine.layer_types = [types[i] for i in layers]
    return mine


def _run_hf(stage: StageModule, c: int, x: torch.Tensor, mb) -> torch.Tensor:
    view, blocks, first, last = stage._hf_views[c]
    prefix = stage.hf_prefix
    # the stage's modules as they are now: transforms (tensor parallelism) swap some after the cut
    view._modules["layers"] = nn.ModuleList([stage.get_submodule(p) for p in blocks])
    view._modules["embed_tokens"] = stage.get_submodule(f"{prefix}.embed_tokens") if first else None
    view._modules["norm"] = stage.get_submodule(f"{prefix}.norm") if last else _IDENTITY
    passed = {k: mb[k] for k in ("attention_mask", "position_ids") if isinstance(mb, dict) and k in mb}
    if stage.hf_composite is not None:
        hidden = _run_composite(stage, view, stage.chunk_layers[c][0] if first else None, x, mb, passed)
    else:
        inputs = {"input_ids": x} if first else {"inputs_embeds": x}
        hidden = view(**inputs, **passed, use_cache=False).last_hidden_state
    return stage.get_submodule("lm_head")(hidden) if last else hidden


def composite_inputs(model: nn.Module) -> list[str]:
    params = inspect.signature(model.forward).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _run_composite(stage: StageModule, view: nn.Module, first: tuple | None, x: torch.Tensor, mb, passed: dict):
    """A multimodal model's chunk. The first runs the model's own base forward (its encoders, their features
    put in place of the image or audio tokens, its positions: Qwen2-VL's 3D ones) over a language model of the
    chunk's layers; a later one runs its layers on the hidden states, at the positions the base computes
    from the batch as the first did. `first`: the first layer's paths (encoders, projector, embedding) on
    the first stage."""
    outer = stage._outer
    outer._modules["language_model"] = view
    if first:
        for path in first[:-1]:                                      # the encoders and the projector
            outer._modules[path.rsplit(".", 1)[1]] = stage.get_submodule(path)
        keys = {k: v for k, v in mb.items() if k not in ("labels", "shift_labels", "input_ids")}
        return outer(input_ids=x, **keys, use_cache=False).last_hidden_state
    if "position_ids" not in passed and hasattr(outer, "compute_3d_position_ids"):
        wants = inspect.signature(outer.compute_3d_position_ids).parameters
        given = {"input_ids": mb["input_ids"], "inputs_embeds": x, "cache": None,
                 **{k: mb.get(k) for k in ("image_grid_thw", "video_grid_thw", "attention_mask",
                                            "mm_token_type_ids", "second_per_grid_ts")}}
        passed["position_ids"] = outer.compute_3d_position_ids(**{k: v for k, v in given.items() if k in wants})
    return view(inputs_embeds=x, **passed, use_cache=False).last_hidden_state
