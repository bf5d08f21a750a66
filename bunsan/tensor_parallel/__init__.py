"""Megatron-style tensor parallelism (and sequence parallelism) applied to a plain model from outside."""

from bunsan.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)
from bunsan.tensor_parallel.loss import vocab_parallel_loss_sum
from bunsan.tensor_parallel.ops import TPContext
from bunsan.tensor_parallel.plan import LLAMA_PLAN, apply_tensor_parallel, consolidate, replicated_parameter_names

__all__ = ["TPContext", "LLAMA_PLAN", "apply_tensor_parallel", "consolidate", "vocab_parallel_loss_sum", "replicated_parameter_names",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead"]
