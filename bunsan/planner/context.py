"""What context parallelism adds to a step's price (cost.py): the K/V all-gather and its gradients'
reduce-scatter over the link the cp group crosses, and attention run on chunks of the row.

The cp group's ranks sit tp apart in the mesh (pp, dp, cp, tp: collectives.py), so tensor parallelism inside
a node pushes a cp group across nodes; every rank keeps its two chunks of seq / (2 cp) tokens and attends
each against the row's keys up to the chunk's end (context_parallel/attention.py), one attention call per
chunk: a short chunk runs a flash kernel below its long-row speed (constants.FLASH_BY_CHUNK). (With its
causal mask by global position SDPA takes its memory-efficient fused kernel rather than the flash one: a tiled
kernel alike, whose per-block work a short chunk amortises as poorly; the curve is taken for it too.)
"""

from __future__ import annotations

from bunsan.estimator.layout import Layout
from bunsan.models.llama import LlamaConfig
from bunsan.planner.collectives import Topology, collective
from bunsan.planner.compute import FLASH_KERNELS, OWN_CURVES, flash_at


def row_kv_bytes(model: LlamaConfig, layout: Layout) -> float:
    """The whole row's K and V per layer and micro-batch (this rank's tensor-parallel share of the key/value
    heads): what the K/V all-gather assembles, and its backward reduce-scatter splits."""
    kv = 2 * layout.micro_batch * layout.seq_len * model.num_key_value_heads * model.head_dim / layout.tp
    return kv * layout.dtype_bytes


def cp_kv_bytes(model: LlamaConfig, layout: Layout) -> float:
    """Bytes one rank receives per layer and micro-batch in the K/V all-gather: (cp-1)/cp of the row's K/V;
    the backward reduce-scatter sends as much."""
    return (layout.cp - 1) / layout.cp * row_kv_bytes(model, layout)


def cp_comm(model: LlamaConfig, layout: Layout, topo: Topology, blocks: int) -> float:
    """Per layer and micro-batch: the K/V all-gather forward (again when recompute reruns attention) and the
    reduce-scatter of their gradients backward, over the cp ranks (tp apart); never overlapped."""
    if layout.cp == 1:
        return 0.0
    gather = collective("all_gather", row_kv_bytes(model, layout), layout.cp, layout.tp, topo)
    scatter = collective("reduce_scatter", row_kv_bytes(model, layout), layout.cp, layout.tp, topo)
    again = layout.checkpointing == "full" or (layout.checkpointing == "selective"
                                               and "attention" in layout.recompute_ops)
    return layout.grad_accum * blocks * ((2 if again else 1) * gather + scatter)


def cp_chunk(layout: Layout) -> int | None:
    """The query rows one attention call runs under context parallelism: the rank's two chunks of
    seq / (2 cp) (context_parallel/attention.py); None without it."""
    return layout.seq_len // (2 * layout.cp) if layout.cp > 1 else None


def cp_note(layout: Layout, topo: Topology, attention: str, gpu=None) -> tuple:
    if layout.cp == 1:
        return ()
    per_node, nodes = topo.span(layout.cp, layout.tp)
    chunk = cp_chunk(layout)
    curve = f"constants.{attention.upper()}_BY_CHUNK" if attention in OWN_CURVES else "the measured curve, " \
        "--kernels" if gpu is not None and gpu.measured is not None else "constants.FLASH_BY_CHUNK"
    flash = f"; flash attention on chunks of {chunk} queries at " \
        f"x{flash_at(chunk, gpu, attention) / flash_at(layout.seq_len, gpu, attention):.2f} the whole row's speed " \
        f"({curve})" if attention in FLASH_KERNELS else ""
    return (f"cp: per layer and micro-batch an all-gather of the row's K and V forward (again under recompute) "
            f"and a reduce-scatter of their gradients backward, over {topo.link(layout.cp, layout.tp).name} (the cp "
            f"group's {layout.cp} ranks, tp {layout.tp} apart, sit {per_node} to a node on {nodes} node(s)); ZeRO "
            f"and gradients over dp x cp; compute of seq_len/cp tokens per rank, their attention against the whole "
            f"row{flash}",)
