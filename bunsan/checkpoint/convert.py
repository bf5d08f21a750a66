"""`bunsan convert`: a sharded checkpoint to one safetensors file or to a Hugging Face directory, offline
(one process, no process group), whatever layout wrote it."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from bunsan.models.hf import save_hf_named, save_llama
from bunsan.transforms.lora import merge_lora as merge_lora_into
from bunsan.models.llama import Llama, LlamaConfig
from bunsan.checkpoint import store
from bunsan.checkpoint.assemble import read_local
from bunsan.checkpoint.final import final_dir, read_final
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
            in_file = store.pieces_by_file(meta)
            bad = [p for f, info in meta["files"].items() if (p := store.check_file(root, t, f, info, in_file.get(f)))]
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


def source_weights(src, tag: str | None) -> tuple[dict[str, torch.Tensor], dict, str]:
    """(weights, {"model": the model's config, "step", "config"?}, what they are) of a checkpoint directory
    (the newest whole one, or `tag`) or of a `bunsan train` output (its final/ weights, LoRA already merged)."""
    root = Path(src)
    final = final_dir(root)
    saved = (root / "latest").exists() or bool(store.complete_tags(root))
    if tag is None and final is not None and not saved:
        meta, state = read_final(final)
        return state, {"model": meta["model"], "step": meta.get("steps", 0), "final": True}, str(final)
    if tag is not None and final is not None and not saved:
        raise CheckpointError(f"{root} is the output of `bunsan train`: its final/ weights have no tags, and it "
                              "holds no checkpoint; convert it without --tag, or point at the checkpoint.dir the "
                              "run saved into")
    state, meta, tag = consolidate(root, tag)
    return state, meta, f"{root}/{tag}"


def transformers_named(state: dict, hf_config: dict) -> bool:
    """Weights of a transformers model (its own names: `model.layers...`, GPT-2's `transformer.h...`) rather
    than of bunsan's Llama (`layers...`, written as a Hugging Face Llama by save_llama)."""
    return hf_config.get("model_type", "llama") != "llama" or any(k.startswith("model.") for k in state)


def _transformers_model(hf_config: dict):
    """transformers' model of `hf_config`: its recorded architecture's class, else (a checkpoint that recorded
    a pipeline stage's class) the causal LM, or the image-text-to-text model of a vision-language config."""
    import transformers
    config = transformers.AutoConfig.for_model(**hf_config)
    named = (hf_config.get("architectures") or [None])[0]
    cls = getattr(transformers, named, None) if isinstance(named, str) else None
    if cls is not None:
        return cls(config)
    auto = transformers.AutoModelForImageTextToText if "vision_config" in hf_config else \
        transformers.AutoModelForCausalLM
    return auto.from_config(config)


def check_against_config(state: dict[str, torch.Tensor], hf_config: dict, where: str) -> str:
    """The weights are exactly those of the model `hf_config` describes (names and shapes), so the directory
    written is one transformers and bunsan can load: a config of 2 layers beside 4 layers' weights is refused.
    The model's class name."""
    try:
        with torch.device("meta"):
            if transformers_named(state, hf_config):
                model = _transformers_model(hf_config)
            else:
                model = Llama(LlamaConfig.from_hf(hf_config))
    except Exception as e:   # noqa: BLE001  (any model class's refusal of the recorded config)
        raise CheckpointError(f"{where}: the model config it records cannot be built to check the weights against "
                              f"({type(e).__name__}: {str(e)[:200]}): its metadata is damaged, or the model's class "
                              "is not in this transformers; convert --to safetensors writes the weights alone") \
            from None
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
    if hf_config.get("tie_word_embeddings"):
        own.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k} {list(state[k].shape)} (the config says {list(own[k])})" for k in own
              if k in state and tuple(state[k].shape) != own[k]]
    if missing or extra or shapes:
        layers, vocab = hf_config.get("num_hidden_layers"), hf_config.get("vocab_size")
        raise CheckpointError(f"{where}: the weights do not match the model config it records ({layers} layers, "
                              f"vocabulary {vocab}): missing {missing[:3]}, unexpected {extra[:3]}, other shapes "
                              f"{shapes[:2]}; the checkpoint's metadata was altered or mixed with another's")
    return type(model).__name__


def convert(src, out, to: str = "safetensors", tag: str | None = None, dtype: str = "fp32",
            merge_lora: bool = False) -> Path:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    state, meta, where = source_weights(src, tag)
    has_lora = any(".lora_A." in k for k in state)
    if merge_lora or (to == "hf" and has_lora):
        if not has_lora:
            raise CheckpointError(f"{where} has no LoRA adapters to merge"
                                  + (" (a training output's final/ weights have them merged already)"
                                     if meta.get("final") else ""))
        lora = meta["config"]["lora"]
        state = merge_lora_into(state, lora["alpha"], lora["r"])
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise CheckpointError(f"{where} holds NaN or infinite weights in {bad[:3]}; it was saved after training "
                              "diverged: convert an earlier checkpoint (--tag)")
    state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in state.items()}
    out = Path(out)
    if to == "safetensors":
        return write_atomically(out, lambda tmp: save_file(state, str(tmp), metadata={
            "format": "pt", "source": where, "step": str(meta.get("step", 0))}))
    if to == "hf":
        if not meta.get("model"):
            raise CheckpointError(f"{where} records no model config, so it cannot become a Hugging Face "
                                  "directory; convert it to one safetensors file instead")
        architecture = check_against_config(state, meta["model"], where)
        if transformers_named(state, meta["model"]):     # a transformers model's names: written as they are
            hf_config = {**meta["model"], "architectures": [architecture]}
            return write_directory(out, lambda tmp: save_hf_named(state, hf_config, tmp))
        config = LlamaConfig.from_hf(meta["model"])
        if config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["embed_tokens.weight"])
        return write_directory(out, lambda tmp: save_llama(state, config, tmp))
    raise ValueError(f"--to {to!r}: use 'safetensors' (one file) or 'hf' (a Hugging Face directory)")


def write_directory(out: Path, write) -> Path:
    """`write(tmp)` into a directory beside `out`, then its files moved into `out` (made if missing): a failure
    (a full disk) leaves `out` as it was and nothing else behind."""
    tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing {out} failed ({type(e).__name__}: {e}); nothing partial was left: free "
                              "space or choose another output") from None
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(tmp.iterdir()):
        os.replace(f, out / f.name)
    tmp.rmdir()
    return out


def write_atomically(out: Path, write) -> Path:
    """`write(tmp)` beside `out`, then renamed over it; a failure (a full disk) leaves nothing behind and says
    how many bytes it needed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(out)
    except (OSError, SafetensorError) as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"writing {out} failed ({type(e).__name__}: {e}); nothing partial was left: free "
                              "space or choose another output") from None
    return out
