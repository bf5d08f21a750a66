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
from bunsan.tensor_parallel.hf_plan import hf_tp_plan, is_hf_model
from bunsan.tensor_parallel.layers import ColumnParallelLinear

# the module whose output holds an attention layer's keys, by its name in the model (bunsan's and transformers')
KEY_PROJECTIONS = ("k_proj", "qkv_proj")


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
    # a transformers model behind bunsan serve's forward (serve/transformers_model.py) splits by its own plan
    target = getattr(model, "hf_model", model)
    head = apply_tensor_parallel(target, TPContext(comm, mesh.tp_group), inference_plan(target))
    if head is None:
        raise ValueError(f"{type(target).__name__}'s tensor-parallel plan has no vocabulary-parallel head (its "
                         "lm_head); inference under --tp needs one to gather the logits: run without --tp")
    head.gather_output = True
    return TPRank(device, comm, mesh.tp_group, mesh.rank, kv_heads_held(target, model.config.num_key_value_heads, tp))


def kv_heads_held(model: nn.Module, kv_heads: int, tp: int) -> int:
    """The key/value heads each rank computes after the split, so the KV cache it keeps: 1/tp of them where the
    keys' projection is split by columns, all of them where the plan gathers its output (Phi-3's fused
    qkv_proj is `colwise_gather_output`: every rank runs every head) or leaves it whole."""
    for name, m in model.named_modules():
        if name.rpartition(".")[2] in KEY_PROJECTIONS:
            split = isinstance(m, ColumnParallelLinear) and not m.gather_output
            return kv_heads // tp if split else kv_heads
    raise ValueError(f"{type(model).__name__} has no module named {' or '.join(KEY_PROJECTIONS)} to read its "
                     "keys' split from, so the KV cache each rank holds is unknown; serve it without --tp")


def inference_plan(model: nn.Module) -> dict | None:
    """The plan to split `model` by for inference: a transformers model's own, with an embedding that is not a
    plain nn.Embedding (Gemma's scales its output) left whole on every rank, which nothing trains here (in
    training the split is refused: a whole embedding tied to a split head would come untied). None: the
    Llama plan."""
    if not is_hf_model(model):
        return None
    plan = hf_tp_plan(model, sequence_parallel=False)
    embedding = model.get_input_embeddings()
    if type(embedding) is not nn.Embedding:
        name = next(n for n, m in model.named_modules() if m is embedding)
        plan.pop(name, None)
    return plan
