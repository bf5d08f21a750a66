"""`bunsan convert`: a sharded checkpoint to one safetensors file or a Hugging Face directory."""

from __future__ import annotations


def add_parser(sub) -> None:
    c = sub.add_parser("convert", help="a sharded checkpoint to one safetensors file or a Hugging Face directory")
    c.add_argument("checkpoint", help="checkpoint directory (the one holding `latest`)")
    c.add_argument("out", help="output file (--to safetensors) or directory (--to hf)")
    c.add_argument("--to", choices=("safetensors", "hf"), default="safetensors")
    c.add_argument("--tag", help="which checkpoint (default: latest, or the newest whole one)")
    c.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    c.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the base weights")


def cmd_convert(args) -> int:
    from bunsan.checkpoint.convert import convert
    out = convert(args.checkpoint, args.out, args.to, args.tag, args.dtype, args.merge_lora)
    print(f"bunsan convert: wrote {out}")
    return 0
