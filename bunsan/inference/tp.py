"""A whole model split over tensor-parallel processes for inference: what `bunsan generate --tp` and
`bunsan serve --tp` both start with. Every rank holds 1/tp of the heads (so of the KV cache) and of the
vocabulary; the head gathers the logits, so every rank sees all of them and any rank can sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from bunsan.comm.process_group import init_distributed
from bunsan.comm.work import Group
from bunsan.tensor_parallel import TPContext, apply_tensor_parallel


@dataclass
class TPRank:
    """This process's side of the split: where its shards live and who it talks to."""
    device: torch.device
    comm: Comm
    group: Group               # the tensor-parallel group
    rank: int                  # in the world: rank 0 prints (generate) or serves (serve)
    kv_heads: int              # key/value heads this rank holds: its slice of the KV cache


def split_over_ranks(model: nn.Module, tp: int, timeout_s: float | None = None) -> TPRank:
    """Join the process group (torchrun's), move `model` to this rank's device and swap its layers for their
    tensor-parallel shards, in place. timeout_s None: the process group's and Comm's own default timeouts."""
    device = init_distributed(timeout_s=timeout_s)     # each rank its GPU (cuda:LOCAL_RANK, NCCL), or the CPU (gloo)
    model.to(device)                   # before the split: each rank cuts its shards where it computes
    mesh = Mesh.create(tp=tp)
    comm = Comm(device=device) if timeout_s is None else Comm(timeout_s=timeout_s, device=device)
    apply_tensor_parallel(model, TPContext(comm, mesh.tp_group)).gather_output = True
    return TPRank(device, comm, mesh.tp_group, mesh.rank, model.config.num_key_value_heads // tp)
