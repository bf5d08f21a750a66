"""Inference across devices: placement of whole blocks over devices, CPU and disk (placement.py)."""

from .placement import Block, place, summary

__all__ = ["Block", "place", "summary"]
