"""Which parameters, at what size, one rank holds under tensor and pipeline parallelism.

`rank_params` cuts the real (meta) model of a ModelShape with the same plan and partitioner training uses
(a transformers model split by the engine's own layers: hf_split.py), so the estimate cannot drift from them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import re
from dataclasses import dataclass

import torch

from bunsan.estimator.hf_split import split_module
from bunsan.estimator.shape import ModelShape
from bunsan.models.blocks import repeated_blocks
from bunsan.pipeline.partition import hf_decoder_prefix, model_layers, partition
from bunsan.tensor_parallel.plan import LLAMA_PLAN, check_llama


@dataclass(frozen=True)
class RankParams:
    """The parameters of one pipeline rank after the tensor-parallel split (element counts)."""
    shapes: list[tuple[int, ...]]     # every trainable parameter this rank holds, after the TP split
    units: list[int]                  # ZeRO-3 units: elements per transformer block held here
    root: int                         # elements outside the blocks (embedding, norms, head) held here
    blocks: int                       # priced blocks held (for activations: a composite's language model's)
    has_embedding: bool
    has_head: bool
    tied_copies: int                  # elements held here that another pipeline rank also holds
    # under expert parallelism: the routed experts' share this rank holds (their own ZeRO group: estimate.py),
    # kept out of the fields above; None without it (the experts are parameters like any other)
    experts: RankParams | None = None

    @functools.cached_property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @functools.cached_property
    def total(self) -> int:
        return sum(self.numels)

    @functools.cached_property
    def memo(self) -> dict:
        """Figures computed from this rank's parameters and a few settings (memory/theory.model_states), kept:
        the planner prices thousands of layouts over a few ranks' parameters."""
        return {}


_LORA_PART = re.compile(r"\.(base_layer|lora_A\.[^.]+|lora_B\.[^.]+)$")
_EXPERTS = re.compile(r"^layers\.\d+\.mlp\.experts\.w[123]$")      # [E, ...]: split over ep by expert
_MOE_SPLIT = re.compile(r"^layers\.\d+\.mlp\.(?:experts\.(w[123])"
                        r"|shared_experts\.(gate_proj|up_proj|down_proj)\.weight)$")


def _tp_shape(name: str, shape: torch.Size, tp: int) -> tuple[int, ...]:
    shape = tuple(shape)
    if tp == 1:
        return shape
    moe = _MOE_SPLIT.search(name)            # a MoE block's experts: split by width (tensor_parallel/moe.py)
    if moe:
        dim = {"w1": 1, "w3": 1, "w2": 2, "gate_proj": 0, "up_proj": 0, "down_proj": 1}[moe.group(1) or moe.group(2)]
        return tuple(n // tp if i == dim else n for i, n in enumerate(shape))
    path = name.rpartition(".")[0]
    lora = _LORA_PART.search(path)          # a peft layer: styled by the layer it wraps
    part = lora.group(1).partition(".")[0] if lora else None
    if lora:
        path = path[:lora.start()]
    style = next((s for pat, s in LLAMA_PLAN.items() if fnmatch.fnmatchcase(path, pat)), None)
    if (style == "column" and part == "lora_A") or (style == "row" and part == "lora_B"):
        return shape                                   # the adapter half that stays whole (tensor_parallel/plan.py)
    if style == "column":
        return (shape[0] // tp,) + shape[1:]
    if style == "row":
        return (shape[0], shape[1] // tp)
    if style in ("vocab_embedding", "vocab_head"):   # the vocabulary is padded to a multiple of tp
        return (-(-shape[0] // tp),) + shape[1:]
    return shape                                       # norms (and anything unplanned) are replicated


def rank_params(shape: ModelShape, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                partition_method: str = "uniform", trainable: bool = True, ep: int = 1) -> list[RankParams]:
    """One RankParams per pipeline rank: of the parameters that train (or, `trainable=False`, of the frozen).
    `ep` > 1: a MoE Llama's routed experts split over ep ranks, in each RankParams' `experts`."""
    if ep > 1:
        moe = shape.llama.moe_config() if shape.llama is not None else None
        if moe is None:
            raise ValueError(f"the estimator prices expert parallelism (ep {ep}) for bunsan's MoE Llama (a preset, "
                             f"a LlamaConfig with moe, a Mixtral config.json); {shape.name} is not one: estimate "
                             "it with ep 1 (every expert on each rank) or measure a step (engine.memory_report())")
        if moe.num_experts % ep:
            raise ValueError(f"ep {ep} does not divide the {moe.num_experts} experts of {shape.name}'s MoE blocks; "
                             f"use an ep that divides {moe.num_experts}")
    model = held = shape.module
    if tp > 1:
        if shape.priced_as is not None:     # (the activations are priced per rank's heads: they must split)
            check_llama(shape.priced_as, tp)
        if shape.llama is None:     # a transformers model: its parameters as the engine's split leaves them
            held = split_module(model, tp, shape.tp_encoders, llama_activations=shape.blocks_as is not None)
    if pp > 1:
        layers = model_layers(model)
        chunks = partition(layers, pp * virtual_stages, partition_method)
        owned = [[layers[i] for c in range(virtual_stages) for i in chunks[c * pp + r]] for r in range(pp)]
        paths = [[p for layer in mine for p in layer.paths] for mine in owned]
    else:
        paths = [[""]]

    # which ranks hold a parameter: the ranks of every path that is its name or a dotted prefix of it ("" is
    # the whole model), looked up prefix by prefix (a scan of every rank's paths per name is quadratic in stages)
    owners: dict[str, set[int]] = {}
    for r, mine in enumerate(paths):
        for path in mine:
            owners.setdefault(path, set()).add(r)

    @functools.lru_cache(maxsize=None)
    def holders(name: str) -> frozenset[int]:
        parts = name.split(".")
        return frozenset(r for i in range(len(parts) + 1) for r in owners.get(".".join(parts[:i]), ()))

    def holds(r: int, name: str) -> bool:
        return r in holders(name)

    # (the split keeps every parameter's name: the stages cut from the whole model hold the split's parameters,
    # as the engine cuts the pipeline before it splits the layers)
    names_of: dict[int, list[str]] = {}
    for name, p in held.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    # ZeRO-3's units as the engine finds them (zero/units.py): `layers.N` in bunsan's Llama, a transformers
    # model's `_no_split_modules` blocks (`model.layers.N`, a vision tower's `encoder.layers.N`)
    module_names = {id(m): n for n, m in held.named_modules()}
    prefixes = [module_names[id(b)] + "." for b in repeated_blocks(held) if id(b) in module_names]

    def block_of(name: str) -> str | None:
        return next((p for p in prefixes if name.startswith(p)), None)
    # the blocks whose activations are priced: a composite model's language model's, not its encoders'
    decoder = "layers." if shape.llama is not None else \
        f"{hf}.layers." if shape.blocks_as is not None and (hf := hf_decoder_prefix(model)) else ""
    params = {id(p): p for p in held.parameters()}
    out = []
    for r in range(len(paths)):
        shapes, root, tied = [], 0, 0
        expert_shapes, expert_units = [], {}
        # every unit this rank holds, in order, whatever trains in it: the trained and the frozen RankParams'
        # units line up, unit by unit, as ZeRO-3 gathers a unit's frozen weights with its trained ones
        blocks = {b: 0 for b in dict.fromkeys(block_of(n) for names in names_of.values() for n in names
                                              if holds(r, n)) if b is not None}
        for pid, names in names_of.items():
            p = params[pid]
            here = [n for n in names if holds(r, n)]
            if not here or p.requires_grad != trainable:
                continue
            cut = _tp_shape(here[0], p.shape, tp) if shape.llama is not None else tuple(p.shape)
            if ep > 1 and _EXPERTS.match(here[0]):      # (ZeRO-3 gathers each block's experts as a unit)
                expert_shapes.append((cut[0] // ep,) + cut[1:])
                unit = block_of(here[0])
                expert_units[unit] = expert_units.get(unit, 0) + math.prod(expert_shapes[-1])
                continue
            shapes.append(cut)
            n = math.prod(shapes[-1])
            if len(frozenset().union(*map(holders, names))) > 1:
                tied += n
            block = block_of(here[0])
            if block is not None:
                blocks[block] += n
            else:
                root += n
        ends = [p.rsplit(".", 1)[-1] for p in paths[r]]
        has_emb = shape.priced_as is not None and (pp == 1 or "embed_tokens" in ends)
        has_head = shape.priced_as is not None and (pp == 1 or "lm_head" in ends)
        priced = sum(b.startswith(decoder) for b in blocks)
        experts = RankParams(expert_shapes, list(expert_units.values()), 0, priced, has_emb, has_head, 0) \
            if ep > 1 else None
        out.append(RankParams(shapes, list(blocks.values()), root, priced, has_emb, has_head, tied, experts))
    return out


def lora_rank_params(shape: ModelShape, lora, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                     partition_method: str = "uniform") -> tuple[list[RankParams], list[RankParams]]:
    """(adapters, frozen base) per pipeline rank for LoRA as `lora` (a config lora section) configures it: the
    model with peft's adapters, cut by the same TP plan and partitioner (adapters split with their layer)."""
    import copy

    from bunsan.transforms.lora import apply_lora
    module = copy.deepcopy(shape.module)    # on meta: nothing is allocated, and the shape stays plain
    apply_lora(module, lora)
    with_adapters = dataclasses.replace(shape, module=module)
    return (rank_params(with_adapters, tp, pp, virtual_stages, partition_method),
            rank_params(with_adapters, tp, pp, virtual_stages, partition_method, trainable=False))
