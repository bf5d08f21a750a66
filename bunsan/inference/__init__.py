"""Inference across devices: placement of whole blocks over devices, CPU and disk (placement.py), a Hugging
Face Llama loaded that way (load.py), and a model split over tensor-parallel processes (tp.py)."""

from bunsan.inference.load import Placed, load, model_blocks, placed
from bunsan.inference.placement import Block, place, summary

__all__ = ["Block", "Placed", "load", "model_blocks", "place", "placed", "summary"]
