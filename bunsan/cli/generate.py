"""`bunsan generate`: sample from a trained checkpoint or a Hugging Face causal LM, on one process, over
tensor-parallel ranks, or spread over devices, CPU and disk (--device-map)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bunsan.cli.launch import relaunch, under_torchrun


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample text from a trained checkpoint")
    g.add_argument("--checkpoint", required=True, help="output dir of `bunsan train` (or its final/ folder)")
    g.add_argument("--prompt", default="def ")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None, help="override the tokenizer recorded in the checkpoint")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel processes (KV cache sharded by heads)")
    g.add_argument("--device-map", choices=("auto", "balanced", "sequential"),
                   help="spread the model over devices, CPU and disk (blocks whole)")
    g.add_argument("--max-memory", help="budgets for --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB (default: all CPU)")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the weights' and the KV cache's dtype (sampling is fp32 whatever it is)")


def torch_dtype(name: str):
    """--dtype's value (fp32, bf16 or fp16; argparse keeps out the rest) as a torch dtype."""
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def refuse_tp_with_device_map(args) -> None:
    """`generate` and `serve` spread a model one way at a time."""
    if args.tp > 1 and args.device_map:
        raise ValueError("--tp and --device-map both spread the model: use one (tensor parallel splits every "
                         "layer over processes; a device map puts whole layers on devices, CPU and disk)")


def hf_tokenizer(checkpoint, tokenizer_path: str | None, vocab_size: int):
    """The tokenizer of a Hugging Face directory: --tokenizer, else its tokenizer.json, else bytes, which only a
    model of at most 256 tokens can use (its ids beyond would have no text)."""
    from bunsan.training.data import load_tokenizer
    tok = Path(checkpoint) / "tokenizer.json"
    if tokenizer_path is None and tok.is_symlink():     # the directory's own file, never one it points at
        raise ValueError(f"{tok} is a symbolic link; copy the tokenizer into the directory or pass --tokenizer")
    path = tokenizer_path or (str(tok) if os.path.lexists(tok) else None)      # (one that is no file: said)
    if path is None and vocab_size > 256:
        raise ValueError(f"{checkpoint} has no tokenizer.json, and its model's vocabulary of {vocab_size} tokens is "
                         "not bytes (256): pass --tokenizer PATH/tokenizer.json (the tokenizer it was trained with)")
    return load_tokenizer(path)


def parse_max_memory(text: str | None) -> dict | None:
    """'0=20GiB,cpu=64GiB' -> {0: bytes, 'cpu': bytes}."""
    from bunsan.estimator.hardware import parse_bytes
    if not text:
        return None
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--max-memory item {item!r} is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=64GiB")
        key = key.strip()
        out[int(key) if key.isdigit() else key] = parse_bytes(value)
    return out


def _generate_placed(args) -> int:
    import torch

    from bunsan.inference import load
    from bunsan.inference.report import lines, start
    from bunsan.models import generate
    from bunsan.models.hf import read_config

    tokenizer = hf_tokenizer(args.checkpoint, args.tokenizer, read_config(args.checkpoint).vocab_size)
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("--prompt is empty; give some text to continue")
    max_memory = parse_max_memory(args.max_memory)
    # the first meta op imports torch's meta-tensor kernels (sympy among them, not the model's memory): before the baseline
    torch.empty(0, device="meta").normal_()
    baseline = start(max_memory)
    model, dmap = load(args.checkpoint, args.device_map, max_memory, dtype=torch_dtype(args.dtype), batch=1,
                       max_seq=ids.shape[1] + args.max_new_tokens, prompt_len=ids.shape[1])
    g = torch.Generator().manual_seed(args.seed)      # on the CPU: next_token draws there, whatever the head's device
    with torch.no_grad():
        out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       eos_token_id=tokenizer.stop_ids, generator=g)
    print(tokenizer.decode(out[0].tolist()))
    print("\n".join(lines(model, dmap, baseline, args.checkpoint)))
    return 0


def _generate_placed_transformers(args, folder: Path) -> int:
    """--device-map for a transformers model that is not a Llama: transformers' own placement."""
    import torch

    from bunsan.inference.transformers_placed import load_placed, placement_line
    from bunsan.models.hf import input_device
    from bunsan.models import generate
    model = load_placed(folder, args.device_map, parse_max_memory(args.max_memory), torch_dtype(args.dtype))
    tokenizer = hf_tokenizer(folder, args.tokenizer, model.config.vocab_size)
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("--prompt is empty; give some text to continue")
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        out = generate(model, ids.to(input_device(model)), args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, eos_token_id=tokenizer.stop_ids, generator=g)
    print(tokenizer.decode(out[0].tolist()))
    print(placement_line(model))
    return 0


def trained_model(path, tokenizer_path=None, command: str = "generate", dtype=None):
    """(model, tokenizer) of `bunsan train`'s output directory (or its final/ folder, or a Hugging Face
    directory: bunsan's Llama for a Llama, transformers' model for another causal LM), on the CPU, its weights
    in `dtype` (default fp32), every one checked (checkpoint/final.py)."""
    import torch

    from bunsan.checkpoint.adapter import adapter_dir
    from bunsan.checkpoint.final import checked_final, final_dir, is_final, read_final
    from bunsan.config.root import Config
    from bunsan.training.hf_model import is_other_architecture
    from bunsan.models import Llama
    from bunsan.models.hf import llama_config, load_llama
    from bunsan.training.data import load_tokenizer
    ckpt = final_dir(path)
    if ckpt is None and adapter_dir(path) is not None:
        return adapted_model(adapter_dir(path), tokenizer_path, command, dtype)
    if ckpt is None:
        raise SystemExit(f"bunsan {command}: {path} has no model.safetensors + config.json; point --checkpoint at "
                         "the output directory of `bunsan train` (or its final/ folder)")
    recorded, other = None, is_other_architecture(ckpt)
    if is_final(ckpt):      # (checked: the digests, the headers; transformers reads another architecture's)
        meta, state = (checked_final(ckpt), None) if other else read_final(ckpt)
        recorded = Config.load(meta.get("bunsan_config", {})).data.tokenizer
    if other:                                 # a transformers model that is not a Llama
        from bunsan.models.hf import pretrained_lm
        model = pretrained_lm(ckpt, dtype=torch.float32)
    elif is_final(ckpt):
        model = Llama(llama_config(meta["model"], ckpt / "config.json"))
        load_exactly(model, state, ckpt)
    else:
        model = load_llama(ckpt)
    if not is_final(ckpt) and tokenizer_path is None and not os.path.lexists(ckpt / "tokenizer.json"):
        raise SystemExit(f"bunsan {command}: {ckpt} is a Hugging Face directory without tokenizer.json; pass "
                         f"--tokenizer PATH/tokenizer.json")
    if dtype is not None:
        model.to(dtype)
    return model.eval(), load_tokenizer(tokenizer_path or recorded_tokenizer(ckpt, recorded, command))


def adapted_model(folder: Path, tokenizer_path, command: str, dtype):
    """A peft LoRA adapter folder (`bunsan train` with lora.save adapter): its base model (adapter_config.json's
    base_model_name_or_path) with the adapter merged in; the adapter folder's tokenizer, else the base's."""
    from bunsan.checkpoint.adapter import merged_with_base, read_adapter
    from bunsan.models import Llama
    base = read_adapter(folder)[0].get("base_model_name_or_path")
    if not isinstance(base, str) or not Path(base).is_dir():
        raise SystemExit(f"bunsan {command}: {folder} is a LoRA adapter whose base model {base!r} is not a "
                         "directory here; point --checkpoint at the merged model (RUN/final) instead")
    print(f"bunsan {command}: {folder} is a LoRA adapter of {base}; merging it into that base", file=sys.stderr)
    own = tokenizer_path or (str(folder / "tokenizer.json") if os.path.lexists(folder / "tokenizer.json") else None)
    model, tokenizer = trained_model(base, own, command, dtype)
    merged = merged_with_base(folder, model.state_dict(), isinstance(model, Llama))
    model.load_state_dict(merged)
    return model, tokenizer


def load_exactly(model, state: dict, where: Path) -> None:
    """The weights exactly: a missing, unexpected or wrongly shaped tensor is an error naming it (a partial
    load would generate from random weights)."""
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k} {list(state[k].shape)} (the config says {list(own[k].shape)})" for k in own
              if k in state and state[k].shape != own[k].shape]
    if missing or extra or shapes:
        raise ValueError(f"{where}/model.safetensors does not match {where}/config.json: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}, other shapes {shapes[:2]}; the directory is damaged or mixed")
    model.load_state_dict(state)


def recorded_tokenizer(ckpt: Path, recorded, command: str):
    """The tokenizer a training output names: bytes, or the tokenizer.json saved beside the weights; a path
    elsewhere is not followed (the directory may come from anyone): --tokenizer says which file to trust."""
    own = ckpt / "tokenizer.json"
    if os.path.lexists(own) and not own.is_symlink():        # (one that is no file: its reader says what it is)
        return str(own)
    if recorded is None or str(recorded) == "byte":
        return recorded
    record = "bunsan.json" if os.path.lexists(ckpt / "bunsan.json") else "config.json"    # (an older final/'s)
    raise ValueError(f"{ckpt / record} records the tokenizer {str(recorded)[:100]!r} (data.tokenizer), and {ckpt} "
                     "holds no tokenizer.json of its own; a path elsewhere is not followed (the directory may come "
                     f"from anyone); pass it yourself: bunsan {command} --tokenizer PATH/tokenizer.json")


def cmd_generate(args) -> int:
    import torch

    from bunsan.models import generate

    if args.device_map:
        refuse_tp_with_device_map(args)
        from bunsan.checkpoint.final import final_dir
        from bunsan.training.hf_model import is_other_architecture
        folder = final_dir(args.checkpoint)
        if folder is not None and is_other_architecture(folder):
            return _generate_placed_transformers(args, folder)
        return _generate_placed(args)
    if args.tp > 1 and not under_torchrun():
        return relaunch(args, args.tp)

    model, tokenizer = trained_model(args.checkpoint, args.tokenizer, "generate", torch_dtype(args.dtype))
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    if ids.numel() == 0:
        raise SystemExit("bunsan generate: --prompt is empty; give some text to continue")
    kv_heads, rank = None, 0
    if args.tp > 1:   # every rank holds 1/tp of the heads (and of the KV cache) and of the vocabulary
        from bunsan.inference.tp import split_over_ranks
        shard = split_over_ranks(model, args.tp)
        ids = ids.to(shard.device)
        kv_heads, rank = shard.kv_heads, shard.rank
    # on the CPU: every rank draws the same tokens from the same gathered logits, whatever its device
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       eos_token_id=tokenizer.stop_ids, generator=g, kv_heads=kv_heads)
    if rank == 0:
        print(tokenizer.decode(out[0].tolist()))
    return 0


