"""Memory estimates per GPU and per host for a model under a layout (`bunsan estimate`)."""

from bunsan.estimator.estimate import Estimate, Item, estimate, estimate_layout
from bunsan.estimator.rank_params import rank_params
from bunsan.estimator.shape import ModelShape, load_shape
from bunsan.memory.theory import zero_paper

__all__ = ["Estimate", "Item", "ModelShape", "estimate", "estimate_layout", "load_shape", "rank_params",
           "zero_paper"]
