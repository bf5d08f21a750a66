"""LoRA adapters as peft saves them (`lora.save: adapter` or `both`): RUN/adapter holds adapter_config.json
(peft's own LoraConfig, `base_model_name_or_path` the --init-from directory) and adapter_model.safetensors
(`base_model.model.<module>.lora_A.weight` / `lora_B`, transformers' module names), beside the tokenizer.
`peft.PeftModel.from_pretrained(base, RUN/adapter)` loads it; `bunsan generate` / `serve` merge it into its
base (`merged_with_base`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bunsan.checkpoint.store import CheckpointError
from bunsan.models.hf import hf_key
from bunsan.models.model_dir import field, read_json
from bunsan.models.tensor_file import TensorFileError, check_dtypes, checked_header

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_dir", "adapter_pairs", "write_adapter", "merged_with_base"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def adapter_dir(path) -> Path | None:
    """RUN/adapter for a training output RUN, or the folder itself when it is a peft adapter; None when neither."""
    path = Path(path)
    for d in (path / "adapter", path):    # (a config that is no file is found: read_adapter says what it is)
        if os.path.lexists(d / ADAPTER_CONFIG) and (d / ADAPTER_WEIGHTS).is_file():
            return d
    return None


def _module_name(stem: str, bunsan_names: bool) -> str:
    return hf_key(stem) if bunsan_names else stem


def write_adapter(out: Path, state: dict, lora_cfg, base: str, bunsan_names: bool, companions=()) -> None:
    """The adapters of `state` (a model's state dict with peft's layers: `<stem>.lora_A.default.weight`) into
    `out` atomically (a folder beside it, renamed); `companions`: (source, name) files copied in (the
    tokenizer's)."""
    import peft
    tensors = {}
    for key, t in state.items():
        for part in ("lora_A", "lora_B"):
            tail = f".{part}.default.weight"
            if key.endswith(tail):
                stem = key[: -len(tail)]
                tensors[f"{PREFIX}{_module_name(stem, bunsan_names)}.{part}.weight"] = t.detach().contiguous()
    if not tensors:
        raise CheckpointError("lora.save asks for the adapter, but the model holds no LoRA weights")
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = peft.LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                             target_modules=list(lora_cfg.target_modules), task_type="CAUSAL_LM",
                             base_model_name_or_path=str(Path(base).resolve()))
    config.save_pretrained(str(tmp))
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt", "producer": "bunsan"})
    for source, name in companions:
        shutil.copyfile(source, tmp / name)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def read_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, the adapter tensors), checked: a small JSON object in a regular file, not a link
    (models/model_dir.py), a LORA config with its rank, floating-point tensors."""
    path = folder / ADAPTER_CONFIG
    config = read_json(path, follow_links=False)
    kind = field(config, "peft_type", path, str, "the kind of adapter")
    if kind != "LORA":
        raise CheckpointError(f"{path}: peft_type is {kind[:40]!r}; bunsan merges and serves LoRA adapters only "
                              "(peft_type LORA): merge this one with peft (merge_and_unload) and point at the result")
    r = field(config, "r", path, int, "the adapter's rank")
    if r <= 0:
        raise CheckpointError(f"{path}: r is {r}, not a positive rank; save the adapter again")
    config = {**config, "lora_alpha": field(config, "lora_alpha", path, (int, float), "its scale: lora_alpha / r",
                                            default=r)}
    path = folder / ADAPTER_WEIGHTS
    try:
        check_dtypes(path, checked_header(path))
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    return config, load_file(str(path))


def adapter_pairs(folder: Path, shapes: dict[str, tuple[int, int]]) -> tuple[float, dict]:
    """(lora_alpha / r, {module name: (lora_A, lora_B)}) of the adapter in `folder`, every pair checked
    against `shapes` (the base's adapted layers by transformers' module name: (out, in)); an adapter for a
    layer the base lacks, or of the wrong shape, is an error naming it."""
    config, tensors = read_adapter(folder)
    scale = float(config.get("lora_alpha", config["r"])) / config["r"]
    stems = {k[len(PREFIX):].rsplit(".lora_", 1)[0] for k in tensors if k.startswith(PREFIX)}
    if len(stems) * 2 != len(tensors):
        raise CheckpointError(f"{folder / ADAPTER_WEIGHTS}: its tensors are not lora_A/lora_B pairs under "
                              f"{PREFIX!r}")
    pairs = {}
    for stem in sorted(stems):
        a, b = tensors.get(f"{PREFIX}{stem}.lora_A.weight"), tensors.get(f"{PREFIX}{stem}.lora_B.weight")
        if a is None or b is None or stem not in shapes:
            raise CheckpointError(f"{folder}: the adapter of {stem} has no lora_A/lora_B pair, or its base has "
                                  "no such layer: it is not an adapter of this base model")
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(shapes[stem]) or b.shape[1] != a.shape[0]:
            raise CheckpointError(f"{folder}: the adapter of {stem} (lora_A {list(a.shape)}, lora_B "
                                  f"{list(b.shape)}) does not fit its base weight {list(shapes[stem])}")
        pairs[stem] = (a, b)
    return scale, pairs


def merged_with_base(folder: Path, base_state: dict[str, torch.Tensor], bunsan_names: bool) -> dict:
    """`base_state` with the adapter of `folder` merged in: W + (lora_alpha / r) B A for every adapted layer
    (checked by adapter_pairs)."""
    names = {_module_name(k[: -len(".weight")], bunsan_names): k for k in base_state
             if k.endswith(".weight") and base_state[k].dim() == 2}
    scale, pairs = adapter_pairs(folder, {stem: tuple(base_state[key].shape) for stem, key in names.items()})
    out = dict(base_state)
    for stem, (a, b) in pairs.items():
        w = base_state[names[stem]]
        out[names[stem]] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out
