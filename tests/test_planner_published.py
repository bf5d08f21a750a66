"""The planner against published runs (tests/published_runs.py, benchmarks/bench_planner.py): pinned so that
a change to the cost model that drifts from what their authors measured fails here.

The target (issues #26, #41) is every run's predicted throughput within 15% of the measured one. The 2021-22
runs (Megatron-LM, BLOOM) and 12 of the 22 runs of 2024-25 (torchtitan, Megatron-Core) meet it; the other 10
are in GAPS with today's error, pinned within 5 points so that a change moving them either way is seen, and
what is suspected to decide each (bench_planner prints the table; RESULTS.md keeps it). The ranks are pinned
at today's figures with a little room. Every run whose published layout the search puts more than 5% behind
its first choice is in DECIDED_BY, with the term `plan --explain` says decides it and the assumption behind
that term; each search is the authors' options only (published_runs.py's spaces: no activation offload where
their software had none)."""

import dataclasses
import functools

import pytest

import published_runs as pr

BY_NAME = {r.name: r for r in pr.RUNS}

H100_500W = ("torchtitan on Grand Teton H100 at 500 W: priced 23-33% fast, eager and compiled alike (their ratio is "
             "within 7%: bench_planner's pairs), so the gap is in what both share: the 500 W cap priced by the "
             "cube-root rule (x0.90, hardware.POWER_EXPONENT), one GEMM efficiency for every shape, and FSDP2's "
             "copies into and out of its all-gather buffers (not priced)")
TP8_SMALL = ("torchtitan's vanilla TP 8 of 8K-token rows: its collectives are priced exposed, as the run had them, "
             "but its GEMMs (an eighth of each weight) at the large-shape efficiency")
TP_OVERLAP = ("tensor-parallel collectives priced exposed (bunsan's engine runs them so), while Megatron-Core ran "
              "--tp-comm-overlap (test_megatron_cores_tp8_rows_are_decided_by_the_tp_overlap)")
# name -> (today's error, the suspected deciding assumption)
GAPS = {
    "Llama 2 70B FSDP sel mb1, 64 A100": (-0.467, "priced bound by its gathers: 70B's parameters at one GPU's NIC "
                                          "share (collectives.py) outlast a 4,096-token micro-batch's compute, "
                                          "where torchtitan measured it as fast as the mb2 run: here NCCL drove "
                                          "more than one NIC per GPU (every NIC: +29%)"),
    "Llama 3.1 405B FSDP16 TP8, 128 H100": (0.408, H100_500W + "; " + TP8_SMALL),
    "Llama 3.1 8B FSDP eager, 8 H100": (0.230, H100_500W),
    "Llama 3.1 8B FSDP compiled, 8 H100": (0.315, H100_500W),
    "Llama 3.1 8B FSDP eager, 128 H100": (0.253, H100_500W),
    "Llama 3.1 8B FSDP compiled, 128 H100": (0.331, H100_500W),
    "Llama 3 70B FSDP32 TP8, 256 H100": (0.250, H100_500W + "; " + TP8_SMALL),
    "Llama 3 8B FSDP8 TP8, 64 H100": (0.481, H100_500W + "; " + TP8_SMALL),
    "GPT 16B, 192 H100": (-0.188, TP_OVERLAP),
    "GPT 32B, 384 H100": (-0.236, TP_OVERLAP),
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
    """Megatron-Core's TP 8 rows are priced slow (32B: -24%): their tensor-parallel collectives are priced
    exposed, and the README's runs overlapped them with the GEMMs (--tp-comm-overlap); priced hidden, the row is
    within 15%. The search ranks the published layout 11% behind its first choice, the same mesh with 4-row
    micro-batches, and `plan --explain` says dp_comm decides it: the gradients' reduce hides only behind the
    last micro-batch's backward and ZeRO-1's parameter all-gather after the step is exposed, where Megatron-Core
    overlapped both (--overlap-grad-reduce --overlap-param-gather)."""
    run = BY_NAME["GPT 32B, 384 H100"]
    r = searched(run.name)
    hidden = dataclasses.replace(r.step, tp_comm=0.0)
    assert abs(pr.per_gpu(run, hidden.total) / run.measured - 1) < 0.15
    assert "most from dp_comm" in pr.explain_published(run, r.plan).decided_by()
    assert (r.first.tp, r.first.micro_batch) == (8, 4) and 0.05 < r.behind_first < 0.15


# Every published layout more than 5% behind the planner's first choice: the term `plan --explain` says decides
# it ("memory" where the layout is ranked after those that fit), and the assumption behind that term
TP_EXPOSED = ("tensor-parallel collectives priced on the critical path, never overlapped (cost.py), at the node's "
              "NVLink bandwidth: the first choice halves TP and pays in pipeline stages instead")
GATHERS_ONE_NIC = ("ZeRO-3's all-gathers and reduce-scatters at one GPU's share of the node's NICs (collectives.py; "
                   "DGX A100's eight HDR links assumed) outlast the compute they hide behind; the first choice's "
                   "TP 2 halves the bytes each GPU gathers")
NO_RECOMPUTE_FITS = ("bunsan's memory estimate fits the step without recompute on the 96 GiB board, where torchtitan "
                     "ran per-op selective checkpointing (its rerun matmuls priced by sac_recompute)")
DP_EXPOSED = ("ZeRO-1's parameter all-gather after the step, and the gradients' reduce hidden only behind the last "
              "micro-batch's backward, priced exposed: Megatron-Core overlapped both (--overlap-grad-reduce "
              "--overlap-param-gather); the first choice's larger micro-batches or TP cut those bytes")
BUBBLE_1F1B = ("the published layout priced as 1F1B without virtual stages (the README gives none: "
               "published_runs.py), whose bubble (p-1)/(m+p-1) the first choice cuts with 4 interleaved chunks per "
               "stage (and CP 2 where it halves TP)")
DECIDED_BY = {
    "GPT 18.4B, 256 A100": ("tp_comm", TP_EXPOSED),
    "GPT 145.6B, 1536 A100": ("tp_comm", TP_EXPOSED),
    "GPT-3 175B, 384 A100": ("tp_comm", TP_EXPOSED),
    "GPT-3 175B, 768 A100": ("tp_comm", TP_EXPOSED),
    "GPT-3 175B, 1536 A100": ("tp_comm", TP_EXPOSED),
    "BLOOM-176B, 384 A100": ("compute", "the busiest stage sets the pace: the 250,880-token head, about four blocks "
                                        "of work, weighs more beside 5 blocks (12 stages) than beside 11 (6)"),
    "Llama 3 8B FSDP, 64 A100": ("dp_comm", GATHERS_ONE_NIC),
    "Llama 3 70B FSDP, 64 A100": ("recompute", "bunsan's estimate fits tp 8 without recompute, where torchtitan "
                                               "recomputed whole blocks at tp 1"),
    "Llama 2 13B FSDP, 64 A100": ("dp_comm", GATHERS_ONE_NIC),
    "Llama 2 13B FSDP sel, 64 A100": ("dp_comm", GATHERS_ONE_NIC),
    "Llama 2 70B FSDP sel mb1, 64 A100": ("memory", "its estimate is within the estimate's measured error of the 80 "
                                                    "GiB (margin.py), so it ranks after every layout that fits "
                                                    "outright; priced, it is also bound by its gathers (GAPS)"),
    "Llama 2 70B FSDP mb2, 64 A100": ("recompute", "bunsan's estimate fits tp 8 without recompute, where torchtitan "
                                                   "recomputed whole blocks at tp 1"),
    "Llama 3.1 8B FSDP eager, 8 H100": ("recompute", NO_RECOMPUTE_FITS),
    "Llama 3.1 8B FSDP compiled, 8 H100": ("recompute", NO_RECOMPUTE_FITS),
    "Llama 3.1 8B FSDP eager, 128 H100": ("recompute", NO_RECOMPUTE_FITS),
    "Llama 3.1 8B FSDP compiled, 128 H100": ("recompute", NO_RECOMPUTE_FITS),
    "Llama 3 70B FSDP32 TP8, 256 H100": ("recompute", "bunsan's estimate fits selective recompute at tp 4, where "
                                                      "torchtitan ran full"),
    "Llama 3 8B FSDP8 TP8, 64 H100": ("tp_comm", TP_EXPOSED + " (here data parallelism: FSDP 16 x TP 4)"),
    "GPT 1.7B, 48 H100": ("dp_comm", DP_EXPOSED),
    "GPT 7.1B, 96 H100": ("dp_comm", DP_EXPOSED),
    "GPT 16B, 192 H100": ("dp_comm", DP_EXPOSED),
    "GPT 32B, 384 H100": ("dp_comm", DP_EXPOSED),
    "GPT 70B, 768 H100": ("tp_comm", TP_EXPOSED + " (interleaved, and its TP collectives were overlapped: "
                                                  "--tp-comm-overlap)"),
    "GPT 119B, 1536 H100": ("bubble", BUBBLE_1F1B),
    "GPT 177B, 2304 H100": ("bubble", BUBBLE_1F1B),
    "GPT 314B, 3072 H100": ("bubble", BUBBLE_1F1B),
    "GPT 462B, 6144 H100": ("bubble", BUBBLE_1F1B),
}


@functools.lru_cache(maxsize=None)
def searched(name: str):
    """`name`'s reproduction with its search, once per session (the tests below share it)."""
    return pr.reproduce(BY_NAME[name])


@pytest.mark.parametrize("name", [r.name for r in pr.RUNS if r.ranked])
def test_plan_explain_names_the_term_that_puts_each_published_layout_behind(name):
    """Every ranked run: within 5% of the first choice, or in DECIDED_BY with the term `plan --explain` names."""
    r = searched(name)
    said = pr.explain_published(BY_NAME[name], r.plan).decided_by()
    if name not in DECIDED_BY:
        assert r.behind_first <= 0.05, f"{name}: {r.behind_first:.1%} behind {r.first.describe()} ({said}): " \
                                       "add it to DECIDED_BY with the assumption that decides it"
        return
    term, assumption = DECIDED_BY[name]
    assert r.behind_first > 0.05, f"{name} is now within 5% of the first choice: take it out of DECIDED_BY"
    named = said.startswith("memory:") if term == "memory" else f"most from {term} " in said
    assert named, f"{name}: {said} (expected {term}: {assumption})"


@pytest.mark.parametrize("name, rank, behind", [
    ("GPT 1.7B, 32 A100", 2, 0.01),
    ("BLOOM-176B, 384 A100", 8, 0.11),
    ("GPT-3 175B, 384 A100", 32, 0.11),
    # 14% behind dp32 tp2 zero3 mb4: ZeRO-3's gathers at one GPU's NIC share (collectives.py) decide it
    ("Llama 2 13B FSDP, 64 A100", 8, 0.15),
])
def test_published_layouts_rank_where_they_ranked(name, rank, behind):
    r = searched(name)
    assert r.rank is not None and r.rank <= rank, f"{name}: rank {r.rank} of {r.ranked}, was {rank}"
    assert r.behind_first <= behind, f"{name}: {r.behind_first:.1%} behind {r.first.describe()}"


def test_zero3_declines_as_table_2_measured():
    """Megatron-LM Table 2: ZeRO-3 without model parallelism falls from 144 to 88 to 44 TFLOP/s per GPU at
    384, 768, 1536 GPUs (fixed batch 1536). The decline, relative to the 384-GPU row, within 20%."""
    runs = [pr.reproduce(r, search_too=False) for r in pr.RUNS if not r.ranked]
    base = runs[0]
    for r in runs[1:]:
        measured = r.run.measured / base.run.measured
        predicted = r.predicted / base.predicted
        assert abs(predicted / measured - 1) < 0.2, f"{r.run.name}: {predicted:.2f} vs {measured:.2f}"
    # the absolute level is too optimistic (DeepSpeed 2021's ZeRO-3 overheads are not modelled): pin the gap
    assert all(0 < r.error < 0.45 for r in runs)
