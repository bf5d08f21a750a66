"""The consolidated weights `bunsan train` leaves in RUN/final: a Hugging Face model directory (transformers'
`from_pretrained` loads it), written atomically with its weights' digest, read back checked (`generate`,
`serve` and `convert` take it).

    RUN/final/model.safetensors   every weight, whole, under transformers' names (shards and an index if big)
    RUN/final/config.json         the model's Hugging Face config
    RUN/final/bunsan.json         {"bunsan_config": ..., "weights": {file: {sha256, bytes}}, "steps", ...}
    RUN/final/tokenizer.json      the tokenizer trained with, unless it was bytes, with the files beside it
                                  that say how to use it (tokenizer_config.json and its chat template,
                                  special_tokens_map.json, chat_template.jinja/.json)
    RUN/final/generation_config.json   the initial model's (--init-from), when it has one: its end-of-turn ids

The directory is untrusted when read (it may come from anyone): bunsan.json and config.json are small JSON
objects in regular files, not links (models/model_dir.py), the weights match the digest bunsan.json records,
their header is consistent (models/tensor_file.py) and every weight is floating point.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from bunsan.checkpoint.store import CheckpointError, sha256
from bunsan.models.hf import save_hf_named, save_llama
from bunsan.models.mixtral_form import from_hub_tensors
from bunsan.models.llama_config import LlamaConfig
from bunsan.models.tensor_file import TensorFileError, check_dtypes, checked_header
from bunsan.models.model_dir import ModelFileError, field, read_json, read_text

WEIGHTS, CONFIG, TOKENIZER, BUNSAN = "model.safetensors", "config.json", "tokenizer.json", "bunsan.json"
# what a Hugging Face tokenizer folder keeps beside tokenizer.json: without them `serve` would not know the
# model's chat template or its end-of-turn token
# (a vision- or audio-language model's processor too: `bunsan serve` reads images with it from final/)
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                        "chat_template.json", "processor_config.json", "preprocessor_config.json",
                        "video_preprocessor_config.json")
GENERATION_CONFIG = "generation_config.json"


def final_dir(path) -> Path | None:
    """RUN/final for a training output RUN, or the folder itself when it holds weights and a config.json (a
    final/ folder, or a Hugging Face directory, its weights in one file or in shards with an index); None when
    neither."""
    path = Path(path)
    for d in (path / "final", path):     # (a JSON file that is no file is found: its reader says what it is)
        weights = (d / WEIGHTS).is_file() or os.path.lexists(d / "model.safetensors.index.json")
        if weights and os.path.lexists(d / CONFIG):
            return d
    return None


def tokenizer_files(tokenizer) -> list[tuple[Path, str]]:
    """(source, name in the output) of the tokenizer trained with and the files beside it that say how to use
    it; none for bytes. A folder, or a tokenizer.json inside one, as Hugging Face lays them out: another file
    name is a tokenizer alone (what sits beside it need not be its)."""
    if tokenizer is None or str(tokenizer) == "byte":
        return []
    source = Path(tokenizer)
    out = [(source / TOKENIZER if source.is_dir() else source, TOKENIZER)]
    folder = source if source.is_dir() else source.parent if source.name == TOKENIZER else None
    if folder is not None:
        out += [(folder / name, name) for name in TOKENIZER_COMPANIONS if (folder / name).is_file()]
    return out


def write_final(tmp: Path, final: Path, state: dict, config, meta: dict, tokenizer, model_dir=None) -> None:
    """The weights as a Hugging Face directory (bunsan's Llama: `config` a LlamaConfig, the state under
    bunsan's names; a transformers model: its shape, the state under its own names) with bunsan.json (`meta`
    and the weights' digest), the tokenizer with its companions and `model_dir`'s generation_config.json into
    `tmp`, fsynced, then renamed to `final` (an older final is replaced whole)."""
    tmp.mkdir(parents=True, exist_ok=True)
    if isinstance(config, LlamaConfig):
        save_llama(state, config, tmp)
    else:
        save_hf_named(state, config.to_hf(), tmp)
    files = sorted(f.name for f in tmp.iterdir() if f.name.endswith(".safetensors"))
    weights = {name: {"sha256": sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in files}
    (tmp / BUNSAN).write_text(json.dumps({**meta, "weights": weights}, indent=2))
    for source, name in tokenizer_files(tokenizer):      # generate/serve read it from here, nowhere else
        shutil.copyfile(source, tmp / name)
    if model_dir is not None and (Path(model_dir) / GENERATION_CONFIG).is_file():
        shutil.copyfile(Path(model_dir) / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        old = final.with_name(f".final.old{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)


def is_final(folder: Path) -> bool:
    """A final/ folder of `bunsan train` (this layout, or the older one whose config.json held bunsan's record)."""
    if os.path.lexists(folder / BUNSAN):
        return True
    try:
        text = read_text(folder / CONFIG, follow_links=False) if os.path.lexists(folder / CONFIG) else None
    except ModelFileError:
        return False          # (read_meta, or the Hugging Face directory's reader, says what is wrong with it)
    return text is not None and '"bunsan_config"' in text


def read_meta(folder: Path) -> dict:
    """bunsan.json with the model's config (config.json) under "model"; from an older final/, config.json,
    which held both. A training output's files are its own: a link among them is refused, never followed."""
    config = folder / CONFIG
    if os.path.lexists(folder / BUNSAN):
        meta = read_json(folder / BUNSAN, follow_links=False)
        run = field(meta, "bunsan_config", folder / BUNSAN, dict, "the run's config", default={})
        return {**meta, "bunsan_config": run, "model": read_json(config, follow_links=False)}
    meta = read_json(config, follow_links=False) if not config.is_symlink() else {}    # (a hub snapshot's link)
    if not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{folder} has no {BUNSAN}: it is a Hugging Face model directory, not the final/ folder "
                              f"of `bunsan train` (which holds {BUNSAN}, bunsan's record of the run, beside the "
                              f"model's {CONFIG} and weights); `bunsan generate` and `bunsan serve` load it as it "
                              "is, `bunsan convert` takes a checkpoint directory (checkpoint.dir) or a training "
                              "output")
    run = field(meta, "bunsan_config", config, dict, "the run's config (an older final/ kept it here)", default={})
    return {**meta, "bunsan_config": run}


def checked_final(folder: Path) -> dict:
    """read_final's checks without reading the weights (a loader of its own reads them): the record."""
    meta = read_meta(folder)
    if (folder / BUNSAN).is_file():
        _read_hf_weights(folder, meta, load=False)
    else:
        read_final(folder)
    return meta


def read_final(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(its record with the model's config under "model", the weights under bunsan's names) of a final/ folder,
    checked: the digest, the header, floating point."""
    meta = read_meta(folder)
    if (folder / BUNSAN).is_file():
        return meta, _read_hf_weights(folder, meta)
    path = folder / WEIGHTS
    recorded = meta.get("weights")
    if isinstance(recorded, dict):
        size = path.stat().st_size
        if size != recorded.get("bytes") or sha256(path) != recorded.get("sha256"):
            raise CheckpointError(f"{path} does not match the digest in {folder / CONFIG} ({size:,} bytes, "
                                  f"{recorded.get('bytes')} recorded): it was altered or damaged after training")
    else:
        print(f"bunsan: {folder / CONFIG} records no digest of {WEIGHTS} (written by an older bunsan); its header "
              "and dtypes are checked, its values cannot be", file=sys.stderr)
    try:
        check_dtypes(path, checked_header(path))
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    return meta, load_file(str(path))


def _read_hf_weights(folder: Path, meta: dict, load: bool = True) -> dict[str, torch.Tensor]:
    recorded = field(meta, "weights", folder / BUNSAN, dict, "each weights file's sha256 and size")
    files = sorted(f.name for f in folder.iterdir() if f.name.endswith(".safetensors"))
    if sorted(recorded) != files:
        raise CheckpointError(f"{folder / BUNSAN} records the weights files {sorted(recorded)}, the folder "
                              f"holds {files}: it was altered or damaged after training")
    state = {}
    for name in files:
        path, want = folder / name, recorded[name]
        size = path.stat().st_size
        if not isinstance(want, dict) or size != want.get("bytes") or sha256(path) != want.get("sha256"):
            raise CheckpointError(f"{path} does not match the digest in {folder / BUNSAN} ({size:,} bytes): it "
                                  "was altered or damaged after training")
        try:
            check_dtypes(path, checked_header(path))
        except TensorFileError as e:
            raise CheckpointError(str(e)) from None
        if load:
            state.update(load_file(str(path)))
    if meta["model"].get("model_type") == "mixtral":     # bunsan's MoE Llama in Mixtral's hub layout
        state = from_hub_tensors(state)
    elif meta["model"].get("model_type", "llama") != "llama":    # a transformers model's own names stay
        return state
    # bunsan's names are transformers' without the leading `model.`; a tied head is the embedding
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if meta["model"].get("tie_word_embeddings") and "embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    return state
