"""Megatron-style tensor parallelism (and sequence parallelism) applied to a plain model from outside."""

from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from .loss import vocab_parallel_loss_sum
from .ops import TPContext
from .plan import LLAMA_PLAN, apply_tensor_parallel, consolidate

__all__ = ["TPContext", "LLAMA_PLAN", "apply_tensor_parallel", "consolidate", "vocab_parallel_loss_sum",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead"]
