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
    assert "flash attention on chunks of 4096 queries at x0.92 the whole row's speed" in out


def test_short_chunks_run_flash_attention_below_its_whole_row_speed():
    """8K tokens: cp 2 runs chunks of 2048 queries, cp 8 chunks of 512. By FLOPs alone the attention of the whole
    row costs the same however it is cut (each rank 1/cp of it); priced by chunk, cp 8's costs more than cp 2's
    by the flash curve's ratio at those lengths (constants.FLASH_BY_CHUNK), and the step says so."""
    from bunsan.planner import compute
    from bunsan.planner.context import cp_chunk

    def attention(cp: int) -> float:             # the whole row's attention core: cp ranks' shares
        lay = Layout(dp=8 // cp, cp=cp, seq_len=8192, micro_batch=1, grad_accum=1)
        local = Layout(seq_len=lay.rank_tokens, micro_batch=1)
        return cp * compute.block_time(SEVEN_B, local, H100, 0.8, keys=8192, chunk=cp_chunk(lay)).attention_forward
    whole = compute.block_time(SEVEN_B, Layout(seq_len=8192, micro_batch=1), H100, 0.8).attention_forward
    assert cp_chunk(Layout(cp=2, seq_len=8192)) == 2048 and cp_chunk(Layout(cp=8, seq_len=8192)) == 512
    assert attention(2) == pytest.approx(whole * compute.flash_at(8192) / compute.flash_at(2048))
    assert attention(8) == pytest.approx(whole * compute.flash_at(8192) / compute.flash_at(512))
    assert attention(8) > 1.5 * attention(2) > 1.5 * whole
    assert compute.flash_at(512) == 0.5 and compute.flash_at(256) == 0.5 and compute.flash_at(1 << 20) == 1.0
    assert 0.68 < compute.flash_at(1500) < 0.83              # between the readings, in log2 of the length
    # the step: the same 8 GPUs, rows and global batch (4), each rank 4096 tokens a step, cp 8 against cp 2
    cp2, cp8 = (_price(Layout(dp=8 // cp, cp=cp, seq_len=8192, micro_batch=1, grad_accum=cp // 2)) for cp in (2, 8))
    assert cp8.compute > cp2.compute and "flash attention on chunks of 512 queries at x0.52" in cp8.assumptions[-1]
    # materialised attention (no flash kernel) is priced by its GEMMs' roofline, not this curve
    lay = Layout(seq_len=1024, micro_batch=1)
    assert compute.block_time(SEVEN_B, lay, H100, 0.8, "materialized", keys=8192, chunk=512).attention_forward == \
        compute.block_time(SEVEN_B, lay, H100, 0.8, "materialized", keys=8192).attention_forward
