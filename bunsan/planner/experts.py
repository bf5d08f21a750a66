"""A MoE model's expert-parallel terms of the step (cost.step_time): which parameters are the routed experts,
and the all-to-alls that carry each block's routed rows to their experts and back.

bunsan's engine folds the ep group inside the dp x cp ranks (comm/mesh.py), tp apart like the gradients'
group; its dispatch is synchronous (expert_parallel/dispatch.py): every all-to-all is on the critical path. Under
tensor parallelism each tensor-parallel rank dispatches its 1/tp slice of the rows, and the tensor-parallel group
gathers what its ranks received and scatters the summed outputs back (expert_parallel/sliced.py).
"""

from __future__ import annotations

from bunsan.estimator.activations import routed_rows
from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.planner.collectives import Topology, collective


def routed_expert_params(model: LlamaConfig) -> int:
    """Elements of a MoE model's routed experts (every block's), 0 for a dense model."""
    moe = model.moe_config()
    if moe is None:
        return 0
    return model.num_hidden_layers * moe.num_experts * 3 * model.hidden_size * moe.expert_intermediate_size


def ep_comm(model: LlamaConfig, layout: Layout, topo: Topology, blocks: int) -> float:
    """The MoE blocks' all-to-alls over the ep ranks (tp apart, folded inside dp x cp): per block and
    micro-batch the routed rows out and the outputs back in forward, their gradients in backward, and the
    forward's two again under full recompute; each moves the rank's 1/tp slice of the routed rows x hidden.
    Under tensor parallelism as many gathers and reduce-scatters of the group's received rows (the rows one
    rank routes) go over the tensor-parallel group, half of each pass's collectives either kind."""
    if model.moe is None or layout.ep == 1:
        return 0.0
    rows = routed_rows(model, layout.micro_batch * layout.seq_len)
    per_block = 4 + (2 if layout.checkpointing == "full" else 0)
    nbytes = rows * model.hidden_size * layout.dtype_bytes
    one = collective("all_to_all", nbytes / layout.tp, layout.ep, layout.tp, topo)
    if layout.tp > 1:
        one += (collective("all_gather", nbytes, layout.tp, 1, topo)
                + collective("reduce_scatter", nbytes, layout.tp, 1, topo)) / 2
    return layout.grad_accum * blocks * per_block * one
