"""The `bunsan` command: run | train | generate | estimate | plan | convert | serve | doctor.

Process management is torchrun's (`torch.distributed.run`): `bunsan run` hands it
the script, `bunsan train --nproc N` hands it `python -m bunsan.cli train ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

WORKER_ARGV = "BUNSAN_WORKER_ARGV"

# Flags of `bunsan train` that map onto config keys.
TRAIN_FLAGS = {
    "preset": ("model.preset", str, "model preset (tiny, small, 135m, 1b, 7b, ...)"),
    "steps": ("train.steps", int, "optimizer steps"),
    "zero": ("zero_optimization.stage", int, "ZeRO stage"),
    "tp": ("tensor_parallel.size", int, "tensor-parallel size (the rest of --nproc is data parallel)"),
    "pp": ("pipeline.stages", int, "pipeline stages (micro-batches: --grad-accum, at least the stages)"),
    "schedule": ("pipeline.schedule", str, "pipeline schedule: gpipe, 1f1b or interleaved"),
    "virtual_stages": ("pipeline.virtual_stages", int, "model chunks per pipeline rank (interleaved schedule)"),
    "micro_batch": ("train_micro_batch_size_per_gpu", int, "micro-batch per data-parallel rank"),
    "grad_accum": ("gradient_accumulation_steps", int, "gradient accumulation steps"),
    "train_batch_size": ("train_batch_size", int, "global batch (samples)"),
    "seq_len": ("data.seq_len", int, "tokens per sample"),
    "lr": ("optimizer.params.lr", float, "learning rate"),
    "seed": ("train.seed", int, "random seed"),
    "output": ("train.output_dir", str, "output directory (metrics, final weights)"),
    "tokenizer": ("data.tokenizer", str, "Hugging Face tokenizer.json (default: bytes)"),
    "timeout": ("train.timeout_s", float, "collective timeout in seconds"),
    "init_from": ("train.init_from", str, "Hugging Face Llama directory whose shape and weights start the run"),
    "checkpoint_dir": ("checkpoint.dir", str, "save checkpoints here, and resume from the newest one"),
    "save_interval": ("checkpoint.save_interval", int, "steps between checkpoints (0: at the end only)"),
}
TRAIN_SWITCHES = {"fp16": "fp16.enabled", "bf16": "bf16.enabled", "compile": "train.compile", "lora": "lora.enabled",
                  "checkpointing": "activation_checkpointing.enabled", "sp": "tensor_parallel.sequence_parallel"}


def _parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"bunsan: --set expects KEY=VALUE (e.g. --set train.steps=50), got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def train_config(args):
    from .config import Config
    from .train import MAIN_JOB
    cfg = Config.load(args.config if args.config else MAIN_JOB)
    updates = {TRAIN_FLAGS[k][0]: v for k in TRAIN_FLAGS if (v := getattr(args, k)) is not None}
    updates.update({key: True for flag, key in TRAIN_SWITCHES.items() if getattr(args, flag)})
    if args.data:
        updates["data.paths"] = args.data
    updates.update(_parse_set(args.set or []))
    return cfg.override(updates) if updates else cfg


def cmd_train(args) -> int:
    if args.nproc > 1 and not _under_torchrun():
        train_config(args)  # fail fast on a bad config, before starting processes
        return _relaunch(args, args.nproc)
    from .doctor.oom import EXIT_CODE, OutOfMemory
    from .train import run_training
    try:
        run_training(train_config(args))
    except OutOfMemory as e:          # the doctor's advice, and a code a script can tell apart
        print(f"bunsan train: {e}", file=sys.stderr, flush=True)
        return EXIT_CODE
    return 0


def cmd_run(args, rest: list[str]) -> int:
    from torch.distributed.run import main as torchrun
    if not rest:
        raise SystemExit("bunsan run: give the script to launch, e.g. bunsan run --nproc-per-node 2 train.py")
    multi_node = any(a.startswith(("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint")) for a in rest)
    torchrun((["--standalone"] if not multi_node else []) + rest)
    return 0


def _relaunch(args, nproc: int) -> int:
    """Run this same command on `nproc` processes under torchrun (arguments travel in the environment:
    torchrun's own parser would read options such as --nproc that follow the module name)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    os.environ[WORKER_ARGV] = json.dumps(args.argv)
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "--module", "bunsan.cli", WORKER_ARGV])
    except ChildFailedError as e:
        print(f"bunsan: {args.cmd} failed on {len(e.failures)} process(es); see their errors above", file=sys.stderr)
        from .doctor.oom import EXIT_CODE
        return EXIT_CODE if any(f.exitcode == EXIT_CODE for f in e.failures.values()) else 1
    return 0


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bunsan", description="Distributed training and inference of LLMs.")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="launch a script on N processes / M nodes (torchrun)", add_help=False)
    r.add_argument("-h", "--help", action="store_true")

    t = sub.add_parser("train", help="train the reference Llama (default: small preset, 2 CPU processes)")
    t.add_argument("config", nargs="?", help="config file (JSON/YAML/TOML, DeepSpeed keys accepted); "
                   "default: the built-in main job (bunsan.train.MAIN_JOB)")
    t.add_argument("--nproc", type=int, default=2, help="processes on this machine (default 2)")
    for name, (key, typ, hlp) in TRAIN_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=f"{hlp} ({key})")
    for flag, key in TRAIN_SWITCHES.items():
        t.add_argument("--" + flag, action="store_true", help=f"set {key}")
    t.add_argument("--data", nargs="+", help="text files, directories or globs (default: Python's stdlib source)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config key, e.g. --set fp16.hysteresis=4")

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
                   help="spread a Hugging Face Llama directory over devices, CPU and disk (blocks whole)")
    g.add_argument("--max-memory", help="budgets for --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB (default: all CPU)")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the weights' and the KV cache's dtype (sampling is fp32 whatever it is)")
    from .cli_plan import add_parsers
    add_parsers(sub)
    from .cli_serve import add_parser as add_serve
    add_serve(sub)
    from .cli_doctor import add_parser as add_doctor
    add_doctor(sub)

    c = sub.add_parser("convert", help="a sharded checkpoint to one safetensors file or a Hugging Face directory")
    c.add_argument("checkpoint", help="checkpoint directory (the one holding `latest`)")
    c.add_argument("out", help="output file (--to safetensors) or directory (--to hf)")
    c.add_argument("--to", choices=("safetensors", "hf"), default="safetensors")
    c.add_argument("--tag", help="which checkpoint (default: latest, or the newest whole one)")
    c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    c.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")
    return p


def cmd_convert(args) -> int:
    from .checkpoint.convert import convert
    out = convert(args.checkpoint, args.out, args.to, args.tag, args.dtype, args.merge_lora)
    print(f"bunsan convert: wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == [WORKER_ARGV]:  # a worker started by `bunsan train --nproc N`
        argv = json.loads(os.environ[WORKER_ARGV])
    parser = build_parser()
    if argv and argv[0] == "run":  # everything after `run` belongs to torchrun
        if len(argv) == 1 or argv[1] in ("-h", "--help"):
            from torch.distributed.run import get_args_parser
            get_args_parser().print_help()
            return 0
        return cmd_run(None, argv[1:])
    args = parser.parse_args(argv)
    args.argv = argv
    from .config import ConfigError
    try:
        if args.cmd == "train":
            return cmd_train(args)
        if args.cmd in ("estimate", "plan"):
            from .cli_plan import cmd_estimate, cmd_plan
            return cmd_estimate(args) if args.cmd == "estimate" else cmd_plan(args)
        if args.cmd == "convert":
            return cmd_convert(args)
        if args.cmd == "doctor":
            from .cli_doctor import cmd_doctor
            return cmd_doctor(args)
        if args.cmd == "serve":
            from .cli_serve import cmd_serve
            return cmd_serve(args)
        from .cli_generate import cmd_generate
        return cmd_generate(args)
    except ConfigError as e:
        print(f"bunsan: config error:\n{e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if args.cmd not in ("estimate", "plan", "convert", "serve", "doctor") and not getattr(args, "device_map", None):
            raise
        print(f"bunsan {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
