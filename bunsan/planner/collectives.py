"""Collectives priced as latency + size / bandwidth over the machine's real topology.

A group is `size` ranks `stride` apart in the rank order (the mesh is pp, dp, cp, tp with tp innermost: a
tensor-parallel group has stride 1, a context-parallel group stride tp, the gradients' dp x cp group stride
tp, a pipeline group stride tp x cp x dp).
Consecutive ranks share a node, so a group keeps `per_node` members in each of the `nodes` nodes it spans.

NCCL runs all-gather and reduce-scatter as rings only, and all-reduce as a ring or (across nodes) a tree;
its own tuning model (NVIDIA/nccl src/graph/tuning.cc) prices them as

    ring:  base + (steps - inter steps) x NVLink step + inter steps x network step + bytes / bus bandwidth
    tree:  base + 2 x ((per node - 1) x NVLink step + log2(nodes) x network step) + bytes / bus bandwidth

with steps = n - 1 (2(n - 1) for an all-reduce) and inter steps = nodes - 1 (2(nodes - 1)). Both move the
same bytes per rank, (n-1)/n x S for a gather or scatter, twice that for an all-reduce; the tree wins on
latency at many nodes and small messages, the ring on large ones, and NCCL picks the faster: so do we.
Across nodes the bus bandwidth is the slower of NVLink and one GPU's share of the node's NICs (the `inter`
link is per GPU). NCCL can drive more than that: it runs a ring per NIC, so a group with several members in a
node reaches the node's NIC total in nccl-tests. Priced that way, the published runs of tests/published_runs.py
come out too fast (15 of 29 within 15%; 70B FSDP on 64 A100 +29%; Megatron-Core's 1.7B +33%; Table 2's ZeRO-3
flat where it fell from 144 to 44 TFLOP/s); priced at one GPU's share, 19 of 29 (bench_planner): what these
training runs' collectives got, beside their compute, is nearer the one-NIC reading, and the planner keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bunsan.estimator.hardware import Interconnect

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Topology:
    """How GPUs sit: `gpus_per_node` per node, `intra` links inside a node, `inter` (per GPU) between nodes."""

    gpus_per_node: int
    intra: Interconnect
    inter: Interconnect

    def span(self, size: int, stride: int) -> tuple[int, int]:
        """(members per node, nodes) of a group of `size` ranks `stride` apart."""
        if stride >= self.gpus_per_node:
            return 1, size
        per_node = min(size, max(1, self.gpus_per_node // stride))
        return per_node, -(-size // per_node)

    def link(self, size: int, stride: int) -> Interconnect:
        """The link that bounds a group's bandwidth: the slowest hop its ring crosses."""
        _, nodes = self.span(size, stride)
        if nodes == 1:
            return self.intra
        return self.inter if self.inter.bytes_per_s <= self.intra.bytes_per_s else self.intra


def collective(kind: str, nbytes: float, size: int, stride: int, topo: Topology) -> float:
    """Seconds for one `kind` collective over `nbytes` (the whole buffer: an all-gather's output, a
    reduce-scatter's input, an all-to-all's send buffer) among `size` ranks `stride` apart. An all-to-all
    (NCCL: a send and a receive to each peer) moves the (n-1)/n of the buffer bound for other ranks, one
    latency step per peer, at the group's slowest link (balanced: every rank sends as much as it receives)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; the cost model prices {', '.join(KINDS)}")
    if size <= 1 or nbytes <= 0:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    per_node, nodes = topo.span(size, stride)
    link = topo.link(size, stride)
    wire = passes * (size - 1) / size * nbytes / link.bytes_per_s
    net_step = topo.inter.latency_s if nodes > 1 else topo.intra.latency_s
    launch = max(topo.intra.launch_s, topo.inter.launch_s if nodes > 1 else 0.0)
    inter_steps = passes * (nodes - 1)
    ring = launch + (passes * (size - 1) - inter_steps) * topo.intra.latency_s + inter_steps * net_step
    if kind != "all_reduce" or nodes == 1:
        return ring + wire
    tree = launch + 2 * ((per_node - 1) * topo.intra.latency_s + math.log2(nodes) * net_step)
    return min(ring, tree) + wire


def p2p(nbytes: float, link: Interconnect) -> float:
    """One send (and its matching receive) of `nbytes` over `link`."""
    return link.launch_s + link.latency_s + nbytes / link.bytes_per_s
