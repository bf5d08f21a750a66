"""Hugging Face Llama directories: config.json plus safetensors (one file, or shards with an index).

bunsan's parameter names are HF's without the leading `model.` (the LM head keeps `lm_head.`), and its
rotary embedding is HF's, so weights move across with a rename. Reading goes tensor by tensor, or
slice by slice (`HFWeights.read(name, dim, start, stop)`), so a tensor-parallel rank reads only its rows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bunsan.models.model_dir import ModelFileError, field, read_json
from bunsan.models.tensor_file import check_dtypes, checked_header
from bunsan.models.llama import Llama, LlamaConfig
from bunsan.models.mixtral_form import hub_name, to_hub_tensors

log = logging.getLogger("bunsan")
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"
# what a Llama's config.json must give: the defaults of bunsan's Llama and of transformers' differ, so a missing
# one would build another model (num_key_value_heads may go: one KV head per query head, in both)
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings")


def hf_key(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def has_chat_template(folder: Path) -> bool:
    """Whether a Hugging Face tokenizer folder carries a chat template (without loading transformers)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return os.path.lexists(config) and bool(read_json(config).get("chat_template"))


def generation_eos_ids(folder: Path) -> set[int]:
    """generation_config.json's eos_token_id (one id or a list: Llama 3's <|end_of_text|>, <|eot_id|>, ...), the
    ids the model ends a turn with; none when the file is missing. A file that is not such JSON is said (what
    model_dir.py refuses, or an eos_token_id of another kind), and ignored: the tokenizer's own end token
    still stops."""
    path = Path(folder) / "generation_config.json"
    if not os.path.lexists(path):
        return set()
    try:
        ids = read_json(path).get("eos_token_id")
    except ModelFileError as e:
        log.warning("%s; meanwhile generation stops at the tokenizer's end token only (not at the file's "
                    "eos_token_id as one id or a list of ids)", e)
        return set()
    if ids is None:
        return set()
    ids = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else ids
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        log.warning("%s: not a JSON object with eos_token_id as one id or a list of ids; stopping at the "
                    "tokenizer's end token only", path)
        return set()
    return set(ids)


def read_config(path) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face Llama directory (or of its config.json), read through model_dir.py."""
    d = Path(path)
    cfg = d / CONFIG if d.is_dir() else d
    if not os.path.lexists(cfg):
        raise FileNotFoundError(f"{d} has no {CONFIG}: point at a Hugging Face model directory "
                                "(config.json + model.safetensors, or shards with model.safetensors.index.json)")
    data = read_json(cfg)
    if data.get("model_type", "llama") not in ("llama", "mixtral"):
        raise ValueError(f"{cfg}: model_type {data['model_type']!r} is not a Llama. bunsan train --init-from and "
                         "generate (one process) take any transformers causal LM; device maps, tensor-parallel "
                         "generation and serve run bunsan's own Llama, so they read model_type 'llama' "
                         "checkpoints (Llama 2/3, SmolLM, TinyLlama, ...) and 'mixtral' ones (bunsan's MoE Llama)")
    return llama_config(data, cfg)


def llama_config(data: dict, path) -> LlamaConfig:
    """LlamaConfig.from_hf of `data`, read from `path`: its SHAPE_FIELDS present, any refusal naming the file."""
    for key in SHAPE_FIELDS:
        field(data, key, path, int, "part of the Llama's shape, which bunsan does not guess")
    field(data, "rope_scaling", path, dict, "how the rotary embedding is scaled", default=None)
    try:
        return LlamaConfig.from_hf(data)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: {e}") from None


class HFWeights:
    """The tensors of a HF directory, opened lazily, by bunsan parameter name."""

    def __init__(self, path):
        self.dir = Path(path)
        if os.path.lexists(self.dir / INDEX):
            self.where = field(read_json(self.dir / INDEX), "weight_map", self.dir / INDEX, dict,
                               "the file of each weight")
            for file in set(self.where.values()):    # shards inside the directory: never a path elsewhere
                if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", "..") \
                        or (self.dir / file).is_symlink():
                    raise ValueError(f"{self.dir / INDEX}: weight_map names a shard that is not a plain file in "
                                     "the directory (a path, '..' or a symlink); the directory is damaged")
        elif (self.dir / SINGLE).is_file():
            self.where = {k: SINGLE for k in checked_header(self.dir / SINGLE)}
        else:
            raise FileNotFoundError(f"{self.dir} has neither {SINGLE} nor {INDEX}; bunsan reads safetensors "
                                    "weights only (convert .bin files with transformers' save_pretrained first)")
        self._check_files()
        self._open: dict[str, object] = {}
        config = read_json(self.dir / CONFIG) if os.path.lexists(self.dir / CONFIG) else {}
        self.tied = bool(config.get("tie_word_embeddings", False))

    def _check_files(self) -> None:
        """Each file's header consistent with its size, and every tensor the index names in the file it names
        (models/tensor_file.py): nothing is read past; read() checks each weight it reads is floating point."""
        self.headers = {}
        for file in sorted(set(self.where.values())):
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"{self.dir / INDEX} names the shard {file!r}, which is not in {self.dir}")
            header = self.headers[file] = checked_header(path)
            missing = sorted(k for k, f in self.where.items() if f == file and k not in header)
            if missing:
                raise ValueError(f"{self.dir / INDEX} puts {missing[:3]} in {file}, which does not hold them; the "
                                 "directory is damaged")

    def check_float(self, keys) -> None:
        """These tensors (the file's keys) are floating point: weights, never integers reinterpreted."""
        for key in keys:
            file = self.where[key]
            check_dtypes(self.dir / file, {key: self.headers[file][key]})

    def _expert_keys(self, name: str) -> list[str] | None:
        """A MoE Llama's experts weight (one 3-D parameter in bunsan) as the hub's one key per expert
        (models/mixtral_form.py); None for any other parameter."""
        if name in self.where:
            return None
        key, along = hub_name(name)
        if along is None:
            return None
        keys = []
        while key.format(e=len(keys)) in self.where:
            keys.append(key.format(e=len(keys)))
        if not keys:
            raise KeyError(f"{self.dir} has no tensor {key.format(e=0)!r} (bunsan parameter {name!r})")
        return keys

    def _key(self, name: str) -> str:
        """The file's key of a parameter: its own name (a transformers model's), else bunsan's Llama name in
        HF's spelling (a MoE Llama's router in Mixtral's)."""
        key = name if name in self.where else hf_key(name)
        if key not in self.where:
            key = hub_name(name)[0]
        if key not in self.where and name == "lm_head.weight" and self.tied:
            key = hf_key("embed_tokens.weight")          # a tied head is often saved once, as the embedding
        if key not in self.where:
            raise KeyError(f"{self.dir} has no tensor {key!r} (bunsan parameter {name!r})")
        return key

    def _file(self, key: str):
        name = self.where[key]
        if name not in self._open:
            self._open[name] = safe_open(str(self.dir / name), framework="pt")
        return self._open[name]

    def shape(self, name: str) -> list[int]:
        experts = self._expert_keys(name)
        key = self._key(name) if experts is None else experts[0]
        shape = list(self._file(key).get_slice(key).get_shape())
        return shape if experts is None else [len(experts), *shape]

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The weight, or its [start, stop) along `dim` (read from disk alone); floating point, never an integer
        or quantised tensor reinterpreted. A MoE Llama's experts come stacked from one tensor per expert."""
        experts = self._expert_keys(name)
        if experts is not None:
            if dim == 0:
                return torch.stack([self.read_key(k) for k in experts[start:stop]])
            return torch.stack([self.read_key(k, None if dim is None else dim - 1, start, stop) for k in experts])
        return self.read_key(self._key(name), dim, start, stop)

    def read_key(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The file's tensor `key`, or its [start, stop) along `dim`."""
        self.check_float([key])
        if dim is None:
            return self._file(key).get_tensor(key)
        sl = self._file(key).get_slice(key)
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return sl[index]


def check_llama_dir(path, cfg: LlamaConfig, weights: HFWeights | None = None) -> HFWeights:
    """The directory's tensors are exactly those of a Llama of `cfg` (its config.json): a missing tensor, one
    more (4 layers of weights under a config of 2), or one of another shape is an error naming it."""
    weights = weights or HFWeights(path)
    with torch.device("meta"):
        model = Llama(cfg)
    want = {}
    for n, p in model.named_parameters():
        key, along = hub_name(n) if cfg.moe is not None else (hf_key(n), None)
        want.update({key: tuple(p.shape)} if along is None else
                    {key.format(e=e): tuple(p.shape[1:]) for e in range(p.shape[0])})
    have = {k for k in weights.where if not k.endswith("rotary_emb.inv_freq")}   # (old HF files keep rope)
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
        if "lm_head.weight" in have:     # some savers write the tied head too: it must be the embedding
            if not torch.equal(weights.read("lm_head.weight"), weights.read("embed_tokens.weight")):
                raise ValueError(f"{path}: config.json says tie_word_embeddings true, but the weights hold an "
                                 "lm_head.weight that differs from the embedding (tying would drop it); set "
                                 "tie_word_embeddings to false in config.json, or remove lm_head.weight")
            have.discard("lm_head.weight")
    missing, extra = sorted(set(want) - have), sorted(have - set(want))
    if missing or extra:
        raise ValueError(f"{path}: its weights do not match its config.json ({cfg.num_hidden_layers} layers, "
                         f"hidden {cfg.hidden_size}): missing {missing[:3]}, unexpected {extra[:3]}"
                         f"{' ...' if len(missing) > 3 or len(extra) > 3 else ''}; fix config.json or the weights")
    weights.check_float(want)
    for key, shape in want.items():
        got = tuple(weights._file(key).get_slice(key).get_shape())
        if got != shape:
            raise ValueError(f"{path}: {key} has shape {list(got)}, its config.json says {list(shape)}")
    return weights


def load_llama(path, dtype: torch.dtype = torch.float32) -> Llama:
    """A bunsan Llama with the weights of a HF Llama directory (exactly its tensors: check_llama_dir)."""
    cfg = read_config(path)
    weights = check_llama_dir(path, cfg)
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = weights.read(name)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{path}: {hf_key(name)} has shape {list(t.shape)}, the config says {list(p.shape)}")
            p.copy_(t)
    model.init_buffers()
    return model.to(dtype)


def save_hf_named(state: dict[str, torch.Tensor], hf_config: dict, out_dir) -> Path:
    """A Hugging Face directory from weights already under their transformers names (a transformers model
    trained by bunsan) and its config.to_dict(); a tied head is left for transformers to tie on load."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.contiguous() for k, t in state.items()
               if not (k == "lm_head.weight" and hf_config.get("tie_word_embeddings"))}
    tmp = out / (SINGLE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / SINGLE)
    config = dict(hf_config)
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def save_llama(state: dict[str, torch.Tensor], config: LlamaConfig, out_dir, dtype: torch.dtype | None = None,
               max_shard_bytes: int = 5 * 1024 ** 3) -> Path:
    """Write a HF Llama directory (config.json, safetensors shards and index) from bunsan's state dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue                                   # HF ties it back to the embedding on load
        t = (t.to(dtype) if dtype is not None else t)
        hub = to_hub_tensors(name, t) if config.moe is not None else None
        if hub is None:
            tensors[hf_key(name)] = t.contiguous()
        else:                                          # a MoE Llama in Mixtral's hub layout: one tensor per expert
            tensors.update({k: v.contiguous() for k, v in hub.items()})
    shards, cur, size = [], {}, 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[key], size = t, size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    hf = config.to_hf()
    hf["torch_dtype"] = str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / CONFIG).write_text(json.dumps(hf, indent=2))
    for f in out.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    return out


def input_device(model) -> torch.device:
    """Where a transformers model takes its token ids: where its embedding computes (Accelerate's execution
    device when a device map placed it, else the embedding's weights)."""
    embedding = model.get_input_embeddings()
    hook = getattr(embedding, "_hf_hook", None)
    return torch.device(getattr(hook, "execution_device", None) or embedding.weight.device)


def cache_keyword(model) -> str | None:
    """The name a transformers model's forward takes its KV cache under: `cache` from transformers 5,
    `past_key_values` before it; None when it takes neither."""
    import inspect
    params = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def pretrained_lm(path, **kwargs):
    """transformers' model of the Hugging Face directory `path` that writes text: its causal LM, or for a
    vision- or audio-language model (LLaVA, Qwen2-VL, Qwen2-Audio: a config with a vision_config or an
    audio_config) its multimodal LM (the image-text-to-text or audio model, with its encoder)."""
    import transformers
    cls = transformers.AutoModelForCausalLM
    config = Path(path) / CONFIG
    if os.path.lexists(config) and {"vision_config", "audio_config"} & set(read_json(config)):
        cls = transformers.AutoModelForMultimodalLM
    return cls.from_pretrained(str(path), **kwargs)
