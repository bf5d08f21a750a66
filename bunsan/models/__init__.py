"""Plain reference models (Llama-style) and named presets.

Model code here is ordinary PyTorch and imports nothing else from bunsan;
parallelism is applied from outside.
"""
from bunsan.models.generate import KVCache, generate
from bunsan.models.llama import Llama, LlamaConfig, flops_per_token
from bunsan.models.presets import build_config, get_preset, presets

__all__ = ["Llama", "LlamaConfig", "presets", "get_preset", "build_config", "KVCache", "generate",
           "flops_per_token"]
