"""bunsan (分散, "distributed"): train and run large language models across many processes and GPUs."""

from __future__ import annotations

from bunsan import models, optim, pipeline, zero
from bunsan.comm import Comm, CommError, Mesh
from bunsan.comm.process_group import backend_name, collective_timeout, init_distributed
from bunsan.config import Config, ConfigError
from bunsan.engine.engine import Engine
from bunsan.estimator import estimate
from bunsan.parallelize import initialize
from bunsan.planner.search import plan
from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
from bunsan.transforms.checkpointing import apply_activation_checkpointing
from bunsan.transforms.compile import apply_compile
from bunsan.transforms.offload import apply_activation_offload
from bunsan.transforms.selective import apply_selective_recompute

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "Config", "ConfigError", "Engine", "Mesh", "Comm", "CommError",
           "models", "optim", "pipeline", "zero", "estimate", "plan", "backend_name", "collective_timeout", "TPContext",
           "apply_tensor_parallel", "apply_activation_checkpointing", "apply_selective_recompute",
           "apply_activation_offload", "apply_compile"]
