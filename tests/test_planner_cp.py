"""Context parallelism in the cost model: its K/V traffic priced over the link its group crosses, and its
attention priced by the chunk each rank runs."""

import pytest

from bunsan.cli.main import main
from bunsan.estimator.hardware import gpu_spec, interconnect
from bunsan.estimator.layout import Layout
from bunsan.models.presets import get_preset
from bunsan.planner.cost import step_time

H100, NVLINK, IB = gpu_spec("h100"), interconnect("nvlink"), interconnect("infiniband")
SEVEN_B = get_preset("7b")


def _price(layout: Layout, per_node: int = 8):
    return step_time(SEVEN_B, layout, H100, NVLINK, IB, per_node)


def test_the_same_cp_group_costs_more_across_nodes_than_within_one():
    """tp 4 x cp 2 x dp 2 on 16 GPUs: the cp pair sits 4 ranks apart (mesh order pp, dp, cp, tp). Eight GPUs to
    a node hold it in one node (NVLink); four to a node put its two ranks on two nodes (InfiniBand). Same
    layout, same bytes: only where the mesh puts the group differs, and the K/V traffic costs what that link
    costs."""
    lay = Layout(dp=2, tp=4, cp=2, seq_len=32768, micro_batch=1, grad_accum=2)
    within, across = _price(lay, per_node=8), _price(lay, per_node=4)
    assert within.compute == across.compute and within.tp_comm == across.tp_comm
    assert across.cp_comm > 5 * within.cp_comm > 0       # NVLink 450 GB/s against 40 GB/s per GPU
    assert "cp nvlink" in within.assumptions[1] and "cp infiniband" in across.assumptions[1]
    assert "over nvlink (the cp group's 2 ranks, tp 4 apart, sit 2 to a node on 1 node(s))" in within.assumptions[-1]
    assert "over infiniband (the cp group's 2 ranks, tp 4 apart, sit 1 to a node on 2 node(s))" in \
        across.assumptions[-1]
    # on one topology, tensor parallelism (innermost) pushes the cp pair out of the node: tp 8 x cp 2 crosses
    wide = _price(Layout(dp=1, tp=8, cp=2, seq_len=32768, micro_batch=1, grad_accum=4))
    assert "cp infiniband" in wide.assumptions[1] and wide.cp_comm > within.cp_comm


def test_plan_prints_the_link_context_parallel_traffic_crosses(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    assert main(["plan", "--model", "1b", "--gpus", "16", "--nodes", "2", "--seq-len", "131072", "--global-batch",
                 "1", "--cp-sizes", "16", "--zero-stages", "1", "--recompute", "full", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "dp1 cp16 tp1" in out and "links: tp nvlink, cp infiniband," in out
    assert "over infiniband (the cp group's 16 ranks, tp 1 apart, sit 8 to a node on 2 node(s))" in out
