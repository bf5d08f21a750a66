"""A Hugging Face Llama spread over devices, CPU and disk for inference (`device_map`, like Accelerate's).

Blocks placed on a device or the CPU are read there once. Blocks placed on "disk" stay on the meta device and
are read from the directory's safetensors right before they run and dropped right after, so the model can be
larger than memory. Inputs follow each block to its device, moved once per forward and device (InputMoves);
the rotary tables sit where the model starts, beside the embedding.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.models.hf import HFWeights, read_config
from bunsan.models.llama import Llama
from bunsan.estimator.inference import InferenceMemory, inference_memory
from bunsan.inference.placement import Block, human, place


@dataclass(frozen=True)
class Placed:
    """What `load` decided and counts for a model, kept beside it (nothing is stamped on the model): the
    memory estimate placement used, per block on disk [times read, bytes read], and the InputMoves that carry
    each block's inputs to its device."""

    memory_estimate: InferenceMemory
    disk_reads: dict
    input_moves: "InputMoves"


_PLACED: "weakref.WeakKeyDictionary[nn.Module, Placed]" = weakref.WeakKeyDictionary()


def placed(model: nn.Module) -> Placed:
    """The placement `load` made of `model`."""
    if model not in _PLACED:
        raise ValueError(f"{type(model).__name__} was not placed by bunsan.inference.load")
    return _PLACED[model]


def model_blocks(model: Llama, dtype: torch.dtype) -> list[Block]:
    """The units placement moves, with their weights' bytes: the embedding, each transformer block, the final
    norm and the head (a tied head owns no bytes of its own: its tensor is the embedding's)."""
    tied = "embedding" if model.config.tie_word_embeddings else None
    item = torch.tensor([], dtype=dtype).element_size()
    seen: set[int] = set()
    def size(m):
        new = [p for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in new)
        return sum(p.numel() for p in new) * item
    out = [Block("embed_tokens", size(model.embed_tokens), tied)]
    out += [Block(f"layers.{i}", size(layer)) for i, layer in enumerate(model.layers)]
    out += [Block("norm", size(model.norm)), Block("lm_head", size(model.lm_head), tied)]
    return out


def memory_blocks(est: InferenceMemory, tied: bool) -> list[Block]:
    """The blocks as placement sees them: weights, plus each layer's KV cache, plus the head's logits beyond one
    step's working set (which every device keeps free as headroom)."""
    tag = "embedding" if tied else None
    return [Block(n, est.block_bytes(n) + (est.logits if n == "lm_head" else 0),
                  tag if n in ("embed_tokens", "lm_head") else None) for n in est.weights]


def cpu_needs(est: InferenceMemory, dmap: dict) -> dict:
    """What blocks on disk still take from CPU memory: their KV caches live there, each is read into it to run,
    and the logits when the head is on disk."""
    disk = [n for n, w in dmap.items() if w == "disk"]
    return {"kv_cache": sum(est.kv_cache.get(n, 0) for n in disk),
            "disk_block": max((est.weights[n] for n in disk), default=0),
            "logits": est.logits if "lm_head" in disk else 0}


def plan(est: InferenceMemory, tied: bool, max_memory: dict, strategy: str = "auto",
         headroom: dict | None = None) -> dict:
    """Memory-aware placement: every device keeps one step's activations free (unless `headroom` says
    otherwise), and the CPU also keeps what the blocks that end up on disk need from it."""
    blocks = memory_blocks(est, tied)
    room = dict(headroom) if headroom is not None else {d: est.step for d in max_memory if d != "disk"}
    dmap = place(blocks, max_memory, strategy, room)
    if "cpu" not in max_memory:
        return dmap
    for _ in blocks:           # more CPU kept free can only send more blocks to disk: this ends
        needs = cpu_needs(est, dmap)
        again = place(blocks, max_memory, strategy, {**room, "cpu": room.get("cpu", 0) + sum(needs.values())})
        if again == dmap:
            break
        dmap = again
    kept = room.get("cpu", 0) + sum(cpu_needs(est, dmap).values())
    if kept > max_memory["cpu"]:
        raise ValueError(
            f"max_memory['cpu'] {human(max_memory['cpu'])} is less than the {human(kept)} the CPU needs even "
            f"with no block on it (one step's activations {human(room.get('cpu', 0))}, the KV caches of the layers "
            f"on disk and one disk block read in); give the CPU more, or lower batch or max_seq (now {est.batch} "
            f"x {est.max_seq} tokens)")
    return dmap


def _device(where) -> torch.device:
    return torch.device("cpu") if where in ("cpu", "disk") else torch.device("cuda", where)


class InputMoves:
    """The blocks' inputs moved to their devices, remembered for one forward of the model.

    Every transformer block takes the rotary cos/sin of the forward's positions besides the hidden state: moved
    afresh by each block's hook they would cost a host-to-device copy per layer per token. Remembered by source
    tensor and target device, the blocks of one device share one copy and a device boundary costs one.
    A copy lives as long as its source does (so a hidden state's copy goes with the hidden state, nothing is held
    past its use) and serves only while the source is unchanged (its version counter: an in-place write means a
    new copy; tensors made under torch.inference_mode have none, and rely on the rest); the root model's hooks
    forget everything at the start and end of each forward."""

    def __init__(self):
        self.moved: dict = {}       # (id(source), device) -> (weak reference to the source, its version, copy)

    def clear(self, *_) -> None:
        self.moved.clear()

    def to(self, t, device: torch.device):
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        key, version = (id(t), device), None if t.is_inference() else t._version
        hit = self.moved.get(key)
        if hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        copy = t.to(device)
        # the entry goes when the source does (before its id can name another tensor)
        self.moved[key] = (weakref.ref(t, lambda _, key=key: self.moved.pop(key, None)), version, copy)
        return copy

    def hook(self, device: torch.device):
        """A forward-pre-hook (with kwargs) that brings a block's tensor inputs to `device`."""
        def move_inputs(module, args, kwargs):
            return tuple(self.to(a, device) for a in args), {k: self.to(v, device) for k, v in kwargs.items()}
        return move_inputs

    def attach(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self.clear)
        model.register_forward_hook(self.clear)


def _rope_where_it_starts(model: Llama, where) -> None:
    """The rotary tables, fp32 whatever the weights' dtype, on the embedding's device (the CPU for one on disk):
    each forward cuts its positions from them where the model starts, and InputMoves carries them from there
    once per device, instead of every layer copying them from the host on every token."""
    device = _device(where)
    model.rope_cos = torch.empty(model.rope_cos.shape, device=device)
    model.rope_sin = torch.empty(model.rope_sin.shape, device=device)
    model.reset_rope()


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


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _PlainReads:
    """Tensors of a HF directory read with ordinary file reads into memory of their own, for blocks on disk.

    safetensors maps its files, and every page of a mapping a block once touched stays in the process's resident
    set while the file is open: the disk blocks would look resident. Read this way, a block's bytes are the
    process's while it runs and the page cache's (the kernel's to drop) after."""

    def __init__(self, weights: HFWeights):
        self.weights, self.headers = weights, {}

    def _header(self, path):
        if path not in self.headers:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self.headers[path] = (json.loads(f.read(n)), 8 + n)
        return self.headers[path]

    def read(self, name: str) -> torch.Tensor:
        key = self.weights._key(name)           # the HF key, with a tied head's fallback to the embedding
        path = self.weights.dir / self.weights.where[key]
        header, base = self._header(path)
        info = header[key]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which disk offload does not "
                             f"read ({sorted(_DTYPES)}); keep this block on a device or the CPU")
        start, stop = info["data_offsets"]
        buf = bytearray(stop - start)
        with open(path, "rb") as f:
            f.seek(base + start)
            f.readinto(buf)
        return torch.frombuffer(buf, dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])


def _read_counted(module: nn.Module, prefix: str, weights: _PlainReads, dtype, reads: dict) -> None:
    _read_into(module, prefix, weights, torch.device("cpu"), dtype)
    count = reads.setdefault(prefix, [0, 0])
    count[0] += 1
    count[1] += sum(p.numel() * p.element_size() for p in module.parameters())


def _drop(module: nn.Module) -> None:
    """Back to the meta device: a disk block holds no memory between its uses."""
    for m, leaf, _ in _params(module):
        p = m._parameters[leaf]
        m._parameters[leaf] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


def load(path, device_map="auto", max_memory: dict | None = None, dtype: torch.dtype = torch.float32,
         headroom: dict | None = None, batch: int = 1, max_seq: int | None = None,
         prompt_len: int | None = None, offload_dir=None) -> tuple[Llama, dict]:
    """(model, device_map) from a HF Llama directory or a bunsan Llama in memory. `max_memory`: {device index:
    bytes, "cpu": bytes}; without it everything goes to the CPU. A dict `device_map` ({block name: device}) is
    used as given. A model in memory whose blocks go to disk is first written to `offload_dir` (safetensors),
    then read back block by block like a directory's.

    Placement counts what generating `batch` sequences of up to `max_seq` tokens (prompt included; default
    the model's max_position_embeddings, at most 4096) with `prompt_len`-token prompts (default max_seq - 1)
    takes: each layer's weights and KV cache, and one step's activations kept free on every device (`headroom`,
    {device: bytes}, replaces those). `placed(model)` holds the estimate and the counts of disk reads."""
    if isinstance(path, nn.Module):
        return _load_module(path, device_map, max_memory, dtype, headroom, batch, max_seq, prompt_len, offload_dir)
    cfg = read_config(path)
    weights = HFWeights(path)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to(dtype)     # the blocks on disk stay meta between reads: in `dtype` too, so the KV cache follows it
    if max_seq is None:
        max_seq = max(min(cfg.max_position_embeddings, 4096), prompt_len or 1)
    est = inference_memory(cfg, batch, max_seq, dtype, prompt_len)
    blocks = model_blocks(model, dtype)
    if isinstance(device_map, dict):
        missing = sorted({b.name for b in blocks} - set(device_map))
        if missing:
            raise ValueError(f"device_map leaves out {missing}; give every block a device (index, 'cpu' or 'disk')")
        dmap = dict(device_map)
    else:
        dmap = plan(est, cfg.tie_word_embeddings, max_memory if max_memory is not None else {"cpu": 1 << 62},
                    device_map, headroom)
    if cfg.tie_word_embeddings and dmap["embed_tokens"] != dmap["lm_head"]:
        raise ValueError("embed_tokens and lm_head share one weight (tie_word_embeddings): put them on one device")
    reads: dict = {}
    plain = _PlainReads(weights)
    _rope_where_it_starts(model, dmap["embed_tokens"])
    moves = InputMoves()
    moves.attach(model)
    for name, where in dmap.items():
        module = model.get_submodule(name)
        device = _device(where)
        module.register_forward_pre_hook(moves.hook(device), with_kwargs=True)
        if where == "disk":
            module.register_forward_pre_hook(
                lambda m, args, n=name: _read_counted(m, n, plain, dtype, reads))
            module.register_forward_hook(lambda m, args, out: _drop(m))
        elif not (name == "lm_head" and cfg.tie_word_embeddings):
            _read_into(module, name, weights, device, dtype)
    if cfg.tie_word_embeddings and dmap["lm_head"] != "disk":
        model.lm_head.weight = model.embed_tokens.weight          # one tensor, as in the model
    _PLACED[model] = Placed(est, reads, moves)
    model.eval()
    return model, dmap


def _load_module(model: Llama, device_map, max_memory, dtype, headroom, batch, max_seq, prompt_len, offload_dir):
    """A model in memory: its blocks moved to their devices, or, with blocks on disk, written to `offload_dir`
    and loaded from there (the disk blocks are then read per use; nothing of them stays in memory)."""
    cfg = getattr(model, "config", None)
    if not isinstance(model, Llama):
        raise ValueError(f"bunsan.inference.load places a bunsan Llama (or a HF Llama directory); got "
                         f"{type(model).__name__}: load it with bunsan.models.hf.load_llama or pass its directory")
    if max_seq is None:
        max_seq = max(min(cfg.max_position_embeddings, 4096), prompt_len or 1)
    est = inference_memory(cfg, batch, max_seq, dtype, prompt_len)
    if isinstance(device_map, dict):
        dmap = dict(device_map)
    else:
        dmap = plan(est, cfg.tie_word_embeddings, max_memory if max_memory is not None else {"cpu": 1 << 62},
                    device_map, headroom)
    if "disk" in dmap.values():
        if offload_dir is None:
            on_disk = [n for n, w in dmap.items() if w == "disk"]
            raise ValueError(f"blocks {on_disk[0]}..{on_disk[-1]} go to disk, and a model in memory has no file to "
                             "read them from: pass offload_dir= (a directory for their safetensors), or give the "
                             "devices and CPU more max_memory")
        from bunsan.models.hf import save_llama
        save_llama(model.state_dict(), cfg, offload_dir)
        return load(offload_dir, dmap, None, dtype, headroom, batch, max_seq, prompt_len)
    missing = sorted({b.name for b in model_blocks(model, dtype)} - set(dmap))
    if missing:
        raise ValueError(f"device_map leaves out {missing}; give every block a device (index, 'cpu' or 'disk')")
    if cfg.tie_word_embeddings and dmap["embed_tokens"] != dmap["lm_head"]:
        raise ValueError("embed_tokens and lm_head share one weight (tie_word_embeddings): put them on one device")
    moves = InputMoves()
    moves.attach(model)
    for name, where in dmap.items():
        module = model.get_submodule(name)
        module.to(device=_device(where), dtype=dtype)
        module.register_forward_pre_hook(moves.hook(_device(where)), with_kwargs=True)
    _rope_where_it_starts(model, dmap["embed_tokens"])
    _PLACED[model] = Placed(est, {}, moves)
    model.eval()
    return model, dmap

