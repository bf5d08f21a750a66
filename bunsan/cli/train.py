"""`bunsan train`: the flags that map onto config keys, and the command."""

from __future__ import annotations

import sys

from bunsan.cli.launch import relaunch, under_torchrun
from bunsan.comm.process_group import shutdown_distributed

# Flags of `bunsan train` that map onto config keys.
TRAIN_FLAGS = {
    "preset": ("model.preset", str, "model preset (tiny, small, 135m, 1b, 7b, ...)"),
    "steps": ("train.steps", int, "optimizer steps"),
    "zero": ("zero_optimization.stage", int, "ZeRO stage"),
    "tp": ("tensor_parallel.size", int, "tensor-parallel size (the rest of --nproc is data parallel)"),
    "cp": ("context_parallel.size", int, "context-parallel size: each row's tokens split over this many ranks"),
    "ep": ("expert_parallel.autoep_size", int, "expert-parallel size: each MoE block's experts split over this "
                                               "many data-parallel ranks (a MoE preset, e.g. tiny-moe)"),
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
    "timeout": ("train.timeout_s", float, "seconds a collective or a set-up wait (rendezvous, joining) may take"),
    "init_from": ("train.init_from", str, "Hugging Face causal LM directory whose shape and weights start the run"),
    "checkpoint_dir": ("checkpoint.dir", str, "save checkpoints here, and resume from the newest one"),
    "save_interval": ("checkpoint.save_interval", int, "steps between checkpoints (0: at the end only)"),
    "format": ("data.format", str, "text, or records (JSONL, Parquet, a saved datasets directory) as "
                                   "prompt_completion, instruction or chat"),
}
TRAIN_SWITCHES = {"fp16": "fp16.enabled", "bf16": "bf16.enabled", "compile": "train.compile", "lora": "lora.enabled",
                  "checkpointing": "activation_checkpointing.enabled", "sp": "tensor_parallel.sequence_parallel",
                  "train_on_prompt": "data.train_on_prompt"}



def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train the reference Llama (default: small preset, 2 CPU processes)")
    t.add_argument("config", nargs="?", help="config file (JSON/YAML/TOML, DeepSpeed keys accepted); "
                   "default: the built-in main job (bunsan.training.loop.MAIN_JOB)")
    t.add_argument("--nproc", type=int, default=2, help="processes on this machine (default 2)")
    for name, (key, typ, hlp) in TRAIN_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=f"{hlp} ({key})")
    for flag, key in TRAIN_SWITCHES.items():
        t.add_argument("--" + flag.replace("_", "-"), dest=flag, action="store_true", help=f"set {key}")
    t.add_argument("--data", nargs="+", help="text files, directories or globs (default: Python's stdlib source)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config key, e.g. --set fp16.hysteresis=4")


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"bunsan: --set expects KEY=VALUE (e.g. --set train.steps=50), got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def train_config(args):
    from bunsan.config.root import Config
    from bunsan.training.loop import MAIN_JOB
    cfg = Config.load(args.config if args.config else MAIN_JOB)
    updates = {TRAIN_FLAGS[k][0]: v for k in TRAIN_FLAGS if (v := getattr(args, k)) is not None}
    if args.ep is not None:      # DeepSpeed's section has its switch apart from its size
        updates["expert_parallel.enabled"] = args.ep > 1
    updates.update({key: True for flag, key in TRAIN_SWITCHES.items() if getattr(args, flag)})
    if args.data:
        updates["data.paths"] = args.data
    updates.update(parse_set(args.set or []))
    return cfg.override(updates) if updates else cfg


def check_init_from(cfg) -> None:
    """train.init_from's config.json read now, before any process starts or reads its corpus (models/model_dir.py):
    a missing or damaged one is one message naming it."""
    if not cfg.train.init_from:
        return
    from bunsan.models.hf import read_config
    from bunsan.training.hf_model import is_other_architecture
    if not is_other_architecture(cfg.train.init_from):        # (transformers reads another one's itself)
        read_config(cfg.train.init_from)


def cmd_train(args) -> int:
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: the number of processes must be at least 1 (default 2)")
    cfg = train_config(args)      # fail fast on a bad config or model directory, before starting processes
    check_init_from(cfg)
    if args.nproc > 1 and not under_torchrun():
        return relaunch(args, args.nproc, cfg.train.timeout_s)
    from bunsan.doctor.oom import EXIT_CODE, OutOfMemory
    from bunsan.training.loop import run_training
    try:
        run_training(cfg)
        shutdown_distributed()
    except OutOfMemory as e:          # the doctor's advice, and a code a script can tell apart
        print(f"bunsan train: {e}", file=sys.stderr, flush=True)
        return EXIT_CODE
    return 0
