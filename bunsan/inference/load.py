"""A Hugging Face Llama spread over devices, CPU and disk for inference (`device_map`, like Accelerate's).

Blocks placed on a device or the CPU are read there once. Blocks placed on "disk" stay on the meta device and
are read from the directory's safetensors right before they run and dropped right after, so the model can be
larger than memory; inputs follow each block to its device.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..models.hf import HFWeights, read_config
from ..models.llama import Llama
from .placement import Block, place


def model_blocks(model: Llama, dtype: torch.dtype) -> list[Block]:
    """The units placement moves: the embedding, each transformer block, the final norm and the head."""
    tied = "embedding" if model.config.tie_word_embeddings else None
    item = torch.tensor([], dtype=dtype).element_size()
    def size(m):
        return sum(p.numel() for p in m.parameters()) * item
    out = [Block("embed_tokens", size(model.embed_tokens), tied)]
    out += [Block(f"layers.{i}", size(layer)) for i, layer in enumerate(model.layers)]
    out += [Block("norm", size(model.norm)), Block("lm_head", size(model.lm_head), tied)]
    return out


def _device(where) -> torch.device:
    return torch.device("cpu") if where in ("cpu", "disk") else torch.device("cuda", where)


def _move_inputs(device):
    def hook(module, args, kwargs):
        move = (lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
    return hook


def _params(module: nn.Module):
    """(owning module, attribute, full name) of every parameter under `module`."""
    for name, m in module.named_modules():
        for leaf, p in list(m._parameters.items()):
            if p is not None:          # nn.Linear(bias=False) keeps a None
                yield m, leaf, f"{name}.{leaf}" if name else leaf


def _read_into(module: nn.Module, prefix: str, weights: HFWeights, device, dtype) -> None:
    for m, leaf, name in _params(module):
        t = weights.read(f"{prefix}.{name}").to(device=device, dtype=dtype)
        m._parameters[leaf] = nn.Parameter(t, requires_grad=False)


def _drop(module: nn.Module) -> None:
    """Back to the meta device: a disk block holds no memory between its uses."""
    for m, leaf, _ in _params(module):
        p = m._parameters[leaf]
        m._parameters[leaf] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


def load(path, device_map="auto", max_memory: dict | None = None, dtype: torch.dtype = torch.float32,
         headroom: dict | None = None) -> tuple[Llama, dict]:
    """(model, device_map). `max_memory`: {device index: bytes, "cpu": bytes}; without it everything goes to
    the CPU. A dict `device_map` ({block name: device}) is used as given."""
    cfg = read_config(path)
    weights = HFWeights(path)
    with torch.device("meta"):
        model = Llama(cfg)
    blocks = model_blocks(model, dtype)
    if isinstance(device_map, dict):
        missing = sorted({b.name for b in blocks} - set(device_map))
        if missing:
            raise ValueError(f"device_map leaves out {missing}; give every block a device (index, 'cpu' or 'disk')")
        dmap = dict(device_map)
    else:
        dmap = place(blocks, max_memory if max_memory is not None else {"cpu": 1 << 62}, device_map, headroom)
    if cfg.tie_word_embeddings and dmap["embed_tokens"] != dmap["lm_head"]:
        raise ValueError("embed_tokens and lm_head share one weight (tie_word_embeddings): put them on one device")
    model.rope_cos = torch.empty(model.rope_cos.shape)
    model.rope_sin = torch.empty(model.rope_sin.shape)
    model.reset_rope()
    for name, where in dmap.items():
        module = model.get_submodule(name)
        device = _device(where)
        module.register_forward_pre_hook(_move_inputs(device), with_kwargs=True)
        if where == "disk":
            module.register_forward_pre_hook(
                lambda m, args, n=name: _read_into(m, n, weights, torch.device("cpu"), dtype))
            module.register_forward_hook(lambda m, args, out: _drop(m))
        elif not (name == "lm_head" and cfg.tie_word_embeddings):
            _read_into(module, name, weights, device, dtype)
    if cfg.tie_word_embeddings and dmap["lm_head"] != "disk":
        model.lm_head.weight = model.embed_tokens.weight          # one tensor, as in the model
    model.layer_devices = [_device(dmap[f"layers.{i}"]) for i in range(cfg.num_hidden_layers)]   # KV caches
    model.eval()
    return model, dmap
