"""A Hugging Face directory (a Llama for bunsan's Llama, or the weights of the transformers model being
trained) into a running engine of any layout, each rank reading only its slices; and an engine (or a bunsan
checkpoint) out to one."""

from __future__ import annotations

import dataclasses

import torch

from bunsan.transforms.lora import is_adapter
from bunsan.models.hf import HFWeights, save_llama
from bunsan.checkpoint.pieces import frozen_of, locals_of


def _local(weights: HFWeights, t) -> torch.Tensor:
    """This rank's local tensor of parameter t: its tensor-parallel rows only, padded as the layer pads. A LoRA
    base weight (peft's `base_layer`) is the HF model's weight of that layer."""
    t = dataclasses.replace(t, name=t.name.replace(".base_layer.", "."))
    shape = weights.shape(t.name)
    if tuple(shape) != t.global_shape:
        raise ValueError(f"{weights.dir}: {t.name} has shape {shape} there and {list(t.global_shape)} in this "
                         "model; build the model from the same config.json (bunsan.models.hf.read_config)")
    if t.tp_dim is None:
        return weights.read(t.name)
    out = torch.zeros(t.local_shape)
    rows = t.global_shape[t.tp_dim] // t.sections     # a fused projection: the rank's rows of each section
    for k, into in enumerate(out.chunk(t.sections, t.tp_dim)):
        if t.valid:
            part = weights.read(t.name, t.tp_dim, k * rows + t.start, k * rows + t.start + t.valid)
            into.narrow(t.tp_dim, 0, t.valid).copy_(part)
    return out


@torch.no_grad()
def load_hf_into_engine(engine, path) -> None:
    """Replace the engine's weights (fp32 masters and the model's copy) with a HF directory's. Optimizer
    states are left as they are: fresh, for a fine-tuning run."""
    weights = HFWeights(path)
    params, _ = locals_of(engine)
    cache: dict[int, torch.Tensor] = {}

    def put(i, lo, master, state):
        if is_adapter(params[i].name):         # LoRA adapters are not in a HF model: they keep their start
            return
        if i not in cache:
            cache.clear()
            cache[i] = _local(weights, params[i]).reshape(-1).float()
        master.copy_(cache[i][lo:lo + master.numel()])
    engine.strategy.visit_state(put)
    for local, lo, t, _ in frozen_of(engine):
        if local.name in ("rope_cos", "rope_sin"):
            continue
        if local.name.endswith(".mlp.expert_bias"):   # a Mixtral has none: its zero start stays (mixtral_form.py)
            continue
        t.copy_(_local(weights, local).reshape(-1)[lo:lo + t.numel()])
    engine.strategy.sync_params_from_master()


def export_engine(engine, out_dir, dtype: torch.dtype | None = None) -> None:
    """Every rank calls it (the weights are gathered); rank 0 writes the HF directory."""
    state = engine.consolidated_state_dict()
    config = getattr(engine.module, "config", None)
    if config is None or not hasattr(config, "to_hf"):
        raise ValueError("exporting to Hugging Face needs a bunsan Llama (its config becomes config.json)")
    if engine.mesh.rank == 0:
        save_llama(state, config, out_dir, dtype=dtype)
