"""`bunsan convert`: a sharded checkpoint to one safetensors file or to a Hugging Face directory, offline
(one process, no process group), whatever layout wrote it."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from bunsan.models.hf import save_hf_named, save_llama
from bunsan.transforms.lora import merge_lora as merge_lora_into
from bunsan.models.llama import LlamaConfig
from bunsan.checkpoint import store
from bunsan.checkpoint.assemble import read_local
from bunsan.checkpoint.pieces import Local
from bunsan.checkpoint.store import CheckpointError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def consolidate(root, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(full weights by parameter name, meta.json, tag) of the newest whole checkpoint (or `tag`)."""
    root = Path(root)
    problems = []
    for t in store.candidates(root, tag):
        try:
            meta = store.read_meta(root, t)
            bad = [p for f, info in meta["files"].items() if (p := store.check_file(root, t, f, info))]
            if bad:
                raise CheckpointError(bad[0])
            reader = store.Reader(root, t, meta)
        except CheckpointError as e:
            problems.append(f"{t}: {e}")
            print(f"bunsan convert: checkpoint {root / t} refused: {e}", file=sys.stderr)
            continue
        if problems:
            print(f"bunsan convert: using {t}, the newest whole checkpoint", file=sys.stderr)
        out = {}
        for (name, kind), pieces in sorted(reader.by_key.items()):
            if kind not in ("master", "frozen"):
                continue
            shape = tuple(pieces[0]["shape"])
            whole = Local(name, shape, shape)
            out[name] = read_local(reader, whole, kind, 0, math.prod(shape)).view(shape)
        return out, meta, t
    raise CheckpointError(f"no loadable checkpoint in {root}: " + ("; ".join(problems) or "none was saved"))


def convert(src, out, to: str = "safetensors", tag: str | None = None, dtype: str = "fp32",
            merge_lora: bool = False) -> Path:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    state, meta, tag = consolidate(src, tag)
    has_lora = any(".lora_A." in k for k in state)
    if merge_lora or (to == "hf" and has_lora):
        if not has_lora:
            raise CheckpointError(f"{src}/{tag} has no LoRA adapters to merge")
        lora = meta["config"]["lora"]
        state = merge_lora_into(state, lora["alpha"], lora["r"])
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items()}
    out = Path(out)
    if to == "safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        save_file(state, str(tmp), metadata={"format": "pt", "source": f"{src}/{tag}", "step": str(meta["step"])})
        tmp.replace(out)
        return out
    if to == "hf":
        if not meta.get("model"):
            raise CheckpointError(f"{src}/{tag} records no model config, so it cannot become a Hugging Face "
                                  "directory; convert it to one safetensors file instead")
        if any(k.startswith("model.") for k in state):     # a transformers model's names: written as they are
            return save_hf_named(state, meta["model"], out)
        config = LlamaConfig.from_hf(meta["model"])
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["embed_tokens.weight"])
        return save_llama(state, config, out)
    raise ValueError(f"--to {to!r}: use 'safetensors' (one file) or 'hf' (a Hugging Face directory)")
