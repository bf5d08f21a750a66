"""The planner against published runs (tests/published_runs.py, benchmarks/bench_planner.py): pinned so that
a change to the cost model that drifts from what their authors measured fails here.

The target (issues #26, #41) is every run's predicted throughput within 15% of the measured one. The 2021-22
runs (Megatron-LM, BLOOM) and 8 of the 22 runs of 2024-25 (torchtitan, Megatron-Core) meet it; the other 14
are in GAPS with today's error, pinned within 5 points so that a change moving them either way is seen, and
what is suspected to decide each (bench_planner prints the table; RESULTS.md keeps it). The ranks are pinned
at today's figures with a little room: the first choices halve tensor parallelism (README "What the planner
assumes"), and `plan --explain` names the term."""

import dataclasses

import pytest

import published_runs as pr

BY_NAME = {r.name: r for r in pr.RUNS}

FSDP_A100 = ("eager torchtitan FSDP2 (April 2024) on A100: priced 15-29% fast; not diagnosed. Suspects: the eager "
             "element-wise passes at 80% of HBM bandwidth, and FSDP2's copies into and out of its all-gather "
             "buffers (not priced)")
H100_500W = ("torchtitan on Grand Teton H100 at 500 W: priced 23-35% fast, eager and compiled alike (their ratio is "
             "within 7%: bench_planner's pairs), so the gap is in what both share: the 500 W cap priced by the "
             "cube-root rule (x0.90, hardware.POWER_EXPONENT), one GEMM efficiency for every shape, and FSDP2's "
             "buffer copies")
TP8_SMALL = ("torchtitan's vanilla TP 8 of 8K-token rows: its collectives are priced exposed, as the run had them, "
             "but its GEMMs (an eighth of each weight) at the large-shape efficiency")
SMALL_GEMMS = ("a small model (hidden 2048-4096): its GEMMs priced at the efficiency of large shapes (GEMM "
               "efficiency by shape is not modelled)")
# name -> (today's error, the suspected deciding assumption)
GAPS = {
    "Llama 3 8B FSDP, 64 A100": (0.174, FSDP_A100),
    "Llama 2 13B FSDP, 64 A100": (0.164, FSDP_A100),
    "Llama 2 13B FSDP sel, 64 A100": (0.152, FSDP_A100),
    "Llama 2 70B FSDP sel mb1, 64 A100": (0.290, FSDP_A100 + "; with torchtitan's per-op checkpointing of a 70B "
                                          "model at micro-batch 1 (published_runs.sac_recompute)"),
    "Llama 3.1 405B FSDP16 TP8, 128 H100": (0.408, H100_500W + "; " + TP8_SMALL),
    "Llama 3.1 8B FSDP eager, 8 H100": (0.230, H100_500W),
    "Llama 3.1 8B FSDP compiled, 8 H100": (0.315, H100_500W),
    "Llama 3.1 8B FSDP eager, 128 H100": (0.271, H100_500W),
    "Llama 3.1 8B FSDP compiled, 128 H100": (0.354, H100_500W),
    "Llama 3 70B FSDP32 TP8, 256 H100": (0.250, H100_500W + "; " + TP8_SMALL),
    "Llama 3 8B FSDP8 TP8, 64 H100": (0.481, H100_500W + "; " + TP8_SMALL),
    "GPT 1.7B, 48 H100": (0.326, SMALL_GEMMS),
    "GPT 7.1B, 96 H100": (0.171, SMALL_GEMMS),
    "GPT 32B, 384 H100": (-0.236, "tensor-parallel collectives priced exposed (bunsan's engine runs them so), while "
                                  "Megatron-Core ran --tp-comm-overlap: test_megatron_cores_tp8_rows_are_decided_by_"
                                  "the_tp_overlap"),
}


@pytest.mark.parametrize("run", [r for r in pr.RUNS if r.ranked and r.name not in GAPS], ids=lambda r: r.name)
def test_published_layouts_are_priced_within_15_percent_of_measured(run):
    r = pr.reproduce(run, search_too=False)
    assert abs(r.error) < 0.15, f"{run.name}: predicted {r.predicted:.4g} vs {run.measured} {run.unit}"


@pytest.mark.parametrize("name", list(GAPS))
def test_the_runs_outside_15_percent_stay_where_they_are(name):
    """Not the target: a pin. A change that brings one within 15% moves it out of GAPS; one that drifts fails."""
    today, why = GAPS[name]
    r = pr.reproduce(BY_NAME[name], search_too=False)
    assert abs(r.error - today) < 0.05, f"{name}: {r.error:+.1%}, was {today:+.1%} ({why})"
    if abs(r.error) < 0.15:
        pytest.fail(f"{name} is now within 15% ({r.error:+.1%}): move it out of GAPS")


def test_megatron_cores_tp8_rows_are_decided_by_the_tp_overlap():
    """Megatron-Core's TP 8 rows are priced slow (32B: -24%) and the search puts TP 4 first, 29% ahead of the
    published TP 8: `plan --explain` says tp_comm decides it. The README's runs overlapped those collectives with
    the GEMMs (--tp-comm-overlap); priced hidden, the row's error is within 15%."""
    run = BY_NAME["GPT 32B, 384 H100"]
    r = pr.reproduce(run)
    comparison = pr.explain_published(run, r.plan)
    assert "most from tp_comm" in comparison.decided_by()
    assert r.first.tp == 4 and r.behind_first > 0.2
    hidden = dataclasses.replace(r.step, tp_comm=0.0)
    assert abs(pr.per_gpu(run, hidden.total) / run.measured - 1) < 0.15


@pytest.mark.parametrize("name, rank, behind", [
    ("GPT 1.7B, 32 A100", 2, 0.01),
    ("BLOOM-176B, 384 A100", 9, 0.14),
    ("GPT-3 175B, 384 A100", 32, 0.11),
    ("Llama 2 13B FSDP, 64 A100", 1, 0.0),
])
def test_published_layouts_rank_where_they_ranked(name, rank, behind):
    r = pr.reproduce(BY_NAME[name])
    assert r.rank is not None and r.rank <= rank, f"{name}: rank {r.rank} of {r.ranked}, was {rank}"
    assert r.behind_first <= behind, f"{name}: {r.behind_first:.1%} behind {r.first.describe()}"


def test_zero3_is_priced_flat_where_table_2_measured_a_decline():
    """Megatron-LM Table 2: ZeRO-3 without model parallelism falls from 144 to 88 to 44 TFLOP/s per GPU at 384,
    768, 1536 GPUs (fixed batch 1536). The model prices it flat (~220): its gathers over whole nodes drive all
    8 NICs (collectives.bus_bandwidth) and hide under the block before's compute at every scale. What the
    measurement shows instead, DeepSpeed 2021's per-parameter gathers and hooks at micro-batches of 1-4, is not
    modelled. Pinned as the known gap it is (the rows are priced, not ranked)."""
    runs = [pr.reproduce(r, search_too=False) for r in pr.RUNS if not r.ranked]
    assert [round(r.error, 1) for r in runs] == [0.5, 1.5, 4.0]
    assert max(r.predicted for r in runs) / min(r.predicted for r in runs) < 1.02


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
