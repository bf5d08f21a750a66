"""The planner against published runs (tests/published_runs.py, benchmarks/bench_planner.py): pinned so that
a change to the cost model that drifts from what Megatron-LM and BLOOM measured fails here.

The bounds are today's figures with a little room, not the issue's targets where those are not met yet
(the ranks: the first choices halve tensor parallelism, see README "What the planner assumes")."""

import pytest

import published_runs as pr

BY_NAME = {r.name: r for r in pr.RUNS}


@pytest.mark.parametrize("run", [r for r in pr.RUNS if r.ranked], ids=lambda r: r.name)
def test_published_layouts_are_priced_within_15_percent_of_measured(run):
    r = pr.reproduce(run, search=False)
    assert abs(r.error) < 0.15, f"{run.name}: predicted {r.predicted_tflops:.0f} vs {run.measured_tflops}"


@pytest.mark.parametrize("name, rank, behind", [
    ("GPT 1.7B, 32 A100", 2, 0.01),
    ("BLOOM-176B, 384 A100", 8, 0.11),
    ("GPT-3 175B, 384 A100", 32, 0.11),
])
def test_published_layouts_rank_where_they_ranked(name, rank, behind):
    r = pr.reproduce(BY_NAME[name])
    assert r.rank is not None and r.rank <= rank, f"{name}: rank {r.rank} of {r.ranked}, was {rank}"
    assert r.behind_first <= behind, f"{name}: {r.behind_first:.1%} behind {r.first.describe()}"


def test_zero3_declines_as_table_2_measured():
    """Megatron-LM Table 2: ZeRO-3 without model parallelism falls from 144 to 88 to 44 TFLOP/s per GPU at
    384, 768, 1536 GPUs (fixed batch 1536). The decline, relative to the 384-GPU row, within 20%."""
    runs = [pr.reproduce(r, search=False) for r in pr.RUNS if not r.ranked]
    base = runs[0]
    for r in runs[1:]:
        measured = r.run.measured_tflops / base.run.measured_tflops
        predicted = r.predicted_tflops / base.predicted_tflops
        assert abs(predicted / measured - 1) < 0.2, f"{r.run.name}: {predicted:.2f} vs {measured:.2f}"
    # the absolute level is too optimistic (DeepSpeed 2021's ZeRO-3 overheads are not modelled): pin the gap
    assert all(0 < r.error < 0.45 for r in runs)


def test_tp_inside_a_node_beats_pipeline_depth_at_a_fixed_data_parallel_size():
    """Narayanan et al. 2021, takeaway 1 (their 162.2B GPT on 64 A100s, one pipeline, batch 128): tensor
    parallelism up to the GPUs of a node before pipeline depth. The model's shape is assumed (hidden 12288,
    96 heads, 88 layers: 160B); the ordering, not the figure's values, is what is checked. Megatron's fused
    kernels: priced compiled, as published_runs.py prices every Megatron run."""
    from bunsan.estimator.hardware import gpu_spec, interconnect
    from bunsan.estimator.layout import Layout
    from bunsan.planner.cost import step_time
    model = pr.gpt(12288, 88, 96)
    seconds = [step_time(model, Layout(tp=t, pp=64 // t, micro_batch=1, grad_accum=128, seq_len=2048,
                                       precision="fp16", checkpointing=True), gpu_spec("a100"),
                         interconnect("nvlink3"), interconnect("hdr"), 8, attention="materialized",
                         compiled=True).total
               for t in (8, 4, 2)]
    assert seconds == sorted(seconds), seconds
