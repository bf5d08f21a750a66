"""Pipeline parallelism: cut the model into stages (partition.py), order the work (schedules.py), run it
(runtime.py, driven by forward_backward.py for the engine's step) and show where the time went (timeline.py).

`setup()` is what `bunsan.initialize` calls when `pipeline.stages > 1`: it keeps (and, for a model built on
the meta device, materialises) only this rank's stages, finds weights tied across stages (a Llama's
embedding and head), and prepares this rank's action list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from bunsan.pipeline import schedules
from bunsan.pipeline.partition import StageModule, model_layers, partition
from bunsan.pipeline.runtime import P2P, Runner
from bunsan.pipeline.timeline import Recorder


@dataclass
class Pipe:
    stage: StageModule
    schedule: str
    p: int
    v: int
    n_micro: int
    actions: list
    runner: Runner | None = None
    tied: list = field(default_factory=list)        # (parameter name here, Group): gradients summed over it
    duplicates: set = field(default_factory=set)    # tied copies counted in the gradient norm elsewhere
    recorder: Recorder | None = None
    canonical: dict = field(default_factory=dict)  # parameter name -> the name its tensor has first in the model
    comm: object = None
    group: object = None       # the pipeline group (the mesh's pp group)

    def start(self, comm, mesh, device) -> None:
        self.comm, self.group = comm, mesh.pp_group
        p2p = P2P(comm, mesh.pp_group, self.p, self.p * self.v, self.n_micro, device)
        self.runner = Runner(self.stage, self.actions, self.p, mesh.pp_rank, p2p, device, self.recorder)


def _owners(layers, chunks: list[list[int]], p: int) -> dict[str, int]:
    """Module path -> the pipeline rank that holds it."""
    out = {}
    for stage, idx in enumerate(chunks):
        for i in idx:
            for path in layers[i].paths:
                out[path] = stage % p
    return out


def _rank_of(name: str, owners: dict[str, int]) -> int | None:
    """The pipeline rank holding parameter `name`: the owner of the longest module path that prefixes it."""
    hits = [(len(path), rank) for path, rank in owners.items() if name == path or name.startswith(path + ".")]
    return max(hits)[1] if hits else None


def setup(model: nn.Module, mesh, cfg, device: torch.device, seed: int) -> Pipe:
    pcfg = cfg.pipeline
    p, v = pcfg.stages, pcfg.virtual_stages
    m = cfg.batch_sizes(mesh.dp).grad_accum
    schedule = schedules.build(pcfg.schedule, p, m, v)   # validates m against p (and v)
    schedules.check(schedule, p, m, v)      # (and proves it completes under NCCL's point-to-point rules)
    layers = model_layers(model)
    chunks = partition(layers, p * v, pcfg.partition)
    r = mesh.pp_rank
    mine = [chunks[c * p + r] for c in range(v)]
    stage = StageModule(model, [[layers[i] for i in idx] for idx in mine], [c * p + r for c in range(v)], p * v)

    # Tied weights: one parameter under several names, held by more than one pipeline rank.
    owners = _owners(layers, chunks, p)
    names_of: dict[int, list[str]] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(prm), []).append(name)
    canonical, tied, duplicates = {}, [], set()
    for names in names_of.values():
        for n in names:
            canonical[n] = names[0]
        ranks = sorted({_rank_of(n, owners) for n in names} - {None})
        if len(ranks) < 2:
            continue
        group = mesh.pp_subgroup(tuple(ranks), "tied")   # collective: every rank, same order
        local = [n for n in names if stage.holds(n.rpartition(".")[0])]
        if local:
            tied.append((local[0], group))
            if r != ranks[0]:
                duplicates.add(local[0])

    if any(prm.is_meta for prm in stage.parameters()):
        _materialize(stage, canonical, device, seed)
    _release_other_stages(model, stage, [layers[i] for c, idx in enumerate(chunks) if c % p != r for i in idx])
    return Pipe(stage, pcfg.schedule, p, v, m, schedule[r], tied=tied, duplicates=duplicates,
                recorder=Recorder.for_device(device), canonical=canonical)


@torch.no_grad()
def _release_other_stages(model: nn.Module, stage: StageModule, others: list) -> None:
    """Leave the layers of the other ranks' stages on the meta device in the caller's model: a caller that
    keeps its model (as every script does) would otherwise keep weights this rank never runs alive beside
    the stage, memory no layout accounts for. A weight tied into this rank's stage stays."""
    kept = {id(t) for t in (*stage.parameters(), *stage.buffers())}
    for layer in others:
        for path in layer.paths:
            for module in model.get_submodule(path).modules():
                for name, prm in list(module._parameters.items()):
                    if prm is not None and id(prm) not in kept and not prm.is_meta:
                        module._parameters[name] = nn.Parameter(prm.detach().to("meta"), prm.requires_grad)
                for name, buf in list(module._buffers.items()):
                    if buf is not None and id(buf) not in kept and not buf.is_meta:
                        module._buffers[name] = buf.to("meta")


@torch.no_grad()
def _materialize(stage: StageModule, canonical: dict[str, str], device: torch.device, seed: int) -> None:
    """Allocate only this stage; draw each weight by its (canonical) name: the same numbers as the whole model."""
    init = stage._init_parameter
    if init is None:
        raise ValueError(f"{stage._source} was built on the meta device but has no init_parameter(name, tensor, "
                         "seed) to initialise one pipeline stage by name; build it on a real device instead")
    stage.to_empty(device=device)
    for name, prm in stage.named_parameters():
        init(canonical.get(name, name), prm, seed)
    stage.init_buffers()


def write_timeline(per_rank: list, pipe: Pipe, out_dir) -> dict:
    """timeline.txt and timeline.png of the last step in out_dir; returns the measured and theoretical bubble.

    Theory: (p-1)/(m+p-1) of the step for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved (Megatron's ratio to the
    ideal step, (p-1)/(v*m), made a fraction of the whole the same way); simulated: see simulated_bubble."""
    from pathlib import Path

    from bunsan.pipeline.timeline import render_png, render_text, summarise
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    theory = schedules.theory_bubble(pipe.schedule, pipe.p, pipe.n_micro, pipe.v)
    sim = simulated_bubble(per_rank, pipe)
    label = (f"{pipe.schedule}, p={pipe.p}, m={pipe.n_micro}" + (f", v={pipe.v}" if pipe.v > 1 else ""))
    summary = summarise(per_rank)
    (out / "timeline.txt").write_text(render_text(per_rank, theory=theory, theory_label=label) + "\n")
    render_png(per_rank, out / "timeline.png", theory=theory, theory_label=label, title=f"pipeline step ({label})")
    return {"bubble": summary.bubble, "theory": theory, "simulated": sim, "schedule": label,
            "makespan_s": summary.makespan}


def simulated_bubble(per_rank: list, pipe: Pipe) -> float:
    """The schedule's bubble with this step's measured per-stage compute times and free communication: what
    the stages' imbalance alone costs (the textbook theory assumes equal stages); the rest is runtime."""
    from bunsan.pipeline.timeline import stage_times
    fwd, bwd = stage_times(per_rank, pipe.p, pipe.v)
    return schedules.simulate(schedules.build(pipe.schedule, pipe.p, pipe.n_micro, pipe.v), pipe.p, pipe.v,
                              fwd, bwd).bubble
