"""Activation bytes under recompute and offload (`activation_checkpointing.mode`, `.offload_blocks`).

What a block keeps for backward, per micro-batch:

  none       everything it saves (activations.py block_bytes)
  full       its input (block_input_bytes); one block's full set lives again while it is recomputed
  selective  the tensors of SELECTIVE_KEPT below (transforms/selective.py keeps exactly these: its policy
             keeps matmul outputs and recomputes the rest), plus the outputs of an op left out of
             `recompute`; the recompute too brings one block's set back, at most block_bytes

With the first N blocks offloaded (transforms/offload.py) what those blocks keep through saved-tensor hooks
goes to host memory instead: everything under none, the block input under full and selective (selective's
kept outputs live in the checkpoint's cache, on the device). Backward brings one block's back at a time. On a
CPU run host memory is the device, and the offload moves nothing.

b samples of s tokens, hidden h, h_kv = kv heads x head_dim, intermediate i, a query heads, d bytes, tensor
parallel t, σ = t under sequence parallelism else 1. Under context parallelism s is the rank's share of a row,
and selective keeps none of the gathered K/V (the recomputed block gathers them again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from bunsan.estimator.activations import Micro, block_bytes, block_input_bytes, stage_activation_bytes
from bunsan.models.blocks import SELECTIVE_OPS
from bunsan.models.llama import LlamaConfig


@dataclass(frozen=True)
class Saved:
    """One tensor a block keeps under selective recompute: its bytes per micro-batch, and the op whose
    recompute drops it (None: kept whatever `recompute` says)."""
    name: str
    nbytes: Callable[[LlamaConfig, Micro], float]
    dropped_by: str | None = None


def _tokens(m: Micro) -> int:
    return m.b * m.s


SELECTIVE_KEPT = (
    Saved("block input", lambda c, m: m.d * _tokens(m) * c.hidden_size / m.seq_div),
    Saved("q, k, v projections", lambda c, m: m.d * _tokens(m) * (c.attention_dim + 2 * c.num_key_value_heads
                                                                   * c.head_dim) / m.tp),
    # o_proj's output (a plain nn.Linear), else the residual after attention: the same bytes
    Saved("attention output", lambda c, m: m.d * _tokens(m) * c.hidden_size / m.seq_div),
    Saved("gate, up projections", lambda c, m: 2 * m.d * _tokens(m) * c.intermediate_size / m.tp),
    # SDPA's output and its fp32 log-sum-exp per query head
    Saved("attention core", lambda c, m: (m.d * _tokens(m) * c.attention_dim
                                          + 4 * _tokens(m) * c.num_attention_heads) / m.tp, "attention"),
    Saved("swiglu", lambda c, m: 2 * m.d * _tokens(m) * c.intermediate_size / m.tp, "swiglu"),   # silu(gate), product
)


def selective_kept(c: LlamaConfig, m: Micro, ops=SELECTIVE_OPS) -> dict[str, float]:
    """Bytes selective recompute keeps for one block, tensor by tensor, when it recomputes `ops`."""
    return {s.name: s.nbytes(c, m) for s in SELECTIVE_KEPT if s.dropped_by is None or s.dropped_by not in ops}


def kept_per_block(c: LlamaConfig, m: Micro, mode: str, ops=SELECTIVE_OPS) -> float:
    """Bytes one block keeps from its forward to its backward under recompute `mode`."""
    if mode == "none":
        return block_bytes(c, m)
    if mode == "full":
        return block_input_bytes(c, m)
    if mode == "selective":
        if c.moe is not None:
            raise ValueError("selective recompute of a MoE block is not priced (what transforms/selective.py keeps "
                             "of its routed experts is not counted); price recompute none or full")
        return sum(selective_kept(c, m, ops).values())
    raise ValueError(f"recompute mode {mode!r} is not one of none, full, selective")


def offloaded_per_block(c: LlamaConfig, m: Micro, mode: str, ops=SELECTIVE_OPS) -> tuple[float, float]:
    """(device, host) bytes of one offloaded block: what goes through saved-tensor hooks moves to the host."""
    kept = kept_per_block(c, m, mode, ops)
    if m.device == "cpu":
        return kept, 0.0
    moved = kept if mode == "none" else block_input_bytes(c, m)
    return kept - moved, moved


def offloaded_count(offload, blocks: float) -> float:
    """Blocks of `blocks` whose activations go to host memory under offload_blocks `offload` (a count, "all")."""
    return blocks if offload == "all" else min(float(offload), blocks)


def stage_bytes(c: LlamaConfig, m: Micro, blocks: float, first: bool, last: bool, mode: str, in_flight: int = 1,
                ops=SELECTIVE_OPS, offload=0) -> dict:
    """activations.py's stage_activation_bytes under recompute `mode` and `offload`: kept (device, all
    micro-batches in flight), host (offloaded), recompute (one block live again in backward: recomputed or
    brought back) and loss_transient."""
    rest = stage_activation_bytes(c, m, 0, first, last, False, in_flight)   # embedding, head, loss
    moved = offloaded_count(offload, blocks)
    device, host = offloaded_per_block(c, m, mode, ops)
    kept = (blocks - moved) * kept_per_block(c, m, mode, ops) + moved * device
    again = block_bytes(c, m) if mode != "none" and blocks else 0.0
    if moved:
        again = max(again, host)
    return {"kept": rest["kept"] + kept * in_flight, "host": moved * host * in_flight, "recompute": again,
            "loss_transient": rest["loss_transient"]}
