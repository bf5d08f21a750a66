"""`deepspeed.compression`: helper's module utilities (what DeepSpeed-Chat's LoRA imports); the compression
library itself (compress, basic_layer) is absent: importable, an error where used (absent.py)."""

from bunsan.deepspeed.compression import helper

__all__ = ["helper"]
