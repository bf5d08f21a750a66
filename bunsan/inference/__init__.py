"""Inference across devices: placement of whole blocks over devices, CPU and disk (placement.py), and a Hugging
Face Llama loaded that way (load.py)."""

from bunsan.inference.load import load, model_blocks
from bunsan.inference.placement import Block, place, summary

__all__ = ["Block", "load", "model_blocks", "place", "summary"]
