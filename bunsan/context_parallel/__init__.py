"""Context parallelism: each rank holds a balanced share of every row's tokens (shard.py) and attention
all-gathers K and V over the context-parallel group (attention.py). For gradients the context-parallel ranks
are data parallel (comm/mesh.py's grad_group)."""

from bunsan.context_parallel.attention import CPContext, ContextParallelAttention, apply_context_parallel
from bunsan.context_parallel.shard import check_length, shard_batch, shard_positions, shard_sequence

__all__ = ["CPContext", "ContextParallelAttention", "apply_context_parallel", "check_length", "shard_batch",
           "shard_positions", "shard_sequence"]
