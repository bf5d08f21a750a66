"""`deepspeed.comm` (`import deepspeed.comm as dist`): torch.distributed-style calls over bunsan's group."""

from bunsan.comm.functional import (ReduceOp, all_gather, all_gather_into_tensor, all_reduce, barrier, broadcast,
                                    get_backend, get_local_rank, get_rank, get_world_size, is_initialized,
                                    new_group, reduce, reduce_scatter_tensor)
from bunsan.deepspeed.initialize import init_distributed

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "get_backend",
           "get_local_rank", "get_rank", "get_world_size", "init_distributed", "is_initialized", "new_group",
           "reduce", "reduce_scatter_tensor"]
