"""torch.distributed-style functions over the default process group, the calls `deepspeed.comm` offers user
scripts (`dist.get_rank()`, `dist.all_reduce(t)`, `dist.barrier()`): bunsan.deepspeed.comm re-exports them.

They act on the process group bunsan.init_distributed made (or the user did); before there is one, the rank
queries answer for a world of one (as DeepSpeed's do before init) and a collective is an error naming the fix.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_backend(group=None) -> str:
    _need("get_backend")
    return str(dist.get_backend(group))


def _need(op: str) -> None:
    if not is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialised; call deepspeed.init_distributed() "
                           "(bunsan.init_distributed()) or deepspeed.initialize(...) first")


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _need("all_reduce")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    _need("broadcast")
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    _need("all_gather")
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    _need("all_gather_into_tensor")
    return dist.all_gather_into_tensor(output, tensor, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    _need("reduce")
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    _need("reduce_scatter_tensor")
    return dist.reduce_scatter_tensor(output, tensor, op=op, group=group, async_op=async_op)


def barrier(group=None, async_op: bool = False):
    _need("barrier")
    return dist.barrier(group=group, async_op=async_op)


def new_group(ranks: list[int] | None = None, **kwargs):
    _need("new_group")
    return dist.new_group(ranks, **kwargs)
