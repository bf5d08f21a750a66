"""The planner against published runs (tests/published_runs.py, benchmarks/bench_planner.py): pinned so that
a change to the cost model that drifts from what their authors measured fails here.

The target (issues #26, #41) is every run's predicted throughput within 15% of the measured one. 27 of the 29
ranked runs meet it; the other 2 are in GAPS with today's error, pinned within 5 points so that a change moving
them either way is seen, and what is suspected to decide each (bench_planner prints the table; RESULTS.md keeps
it). The H100's sustained fraction (hardware.SUSTAINED_HOPPER) is fitted to Megatron-Core's nine runs, and
test_the_hopper_sustained_fraction_is_the_fit_to_megatron_core re-fits it; torchtitan's seven H100 runs are held
out from that fit. The ranks are pinned at today's figures with a little room. Every run whose published layout
the search puts more than 5% behind its first choice is in DECIDED_BY, with the term `plan --explain` says
decides it and the assumption behind that term; each search is the authors' options only (published_runs.py's
spaces: no activation offload where their software had none, Megatron-Core's README overlaps priced).
MosaicML's MPT benchmarks (published_mpt.py: 19 FSDP runs on A100 80GB, A100 40GB and H100, 2023) are priced,
not ranked, and held out from every fit: 17 within 15%, the other 2 pinned in MPT_GAPS. So are Meta's Llama 3
405B pre-training runs (published_llama3.py: TP 8 x PP 16 on 8,192 and 16,384 H100, and CP 16 at 131,072
tokens; 2024): all three within 15%, at the virtual-stage count the planner finds cheapest (Meta published
none). So are NVIDIA's DGX Cloud recipes (published_nemo.py: NeMo's Llama 3.1 8B and 70B, Nemotron-4 15B and
340B and GPT-3 175B on 8-2,048 H100, every BF16 column of their tables; 2024): all 29 within 15%. So are bunsan's
own four runs on an H100 (measured_gpu_runs.py: 1B eager and compiled, with and without recompute; 2026-12-05):
all four within 15%."""

import dataclasses
import functools
import math

import pytest

import measured_gpu_runs as gpu_runs
import published_llama3 as llama3
import published_mpt as mpt
import published_nemo as nemo
import published_runs as pr
from bunsan.estimator import hardware

pytestmark = pytest.mark.e2e    # the planner's whole search of each published run: the end-to-end tier

BY_NAME = {r.name: r for r in pr.RUNS + mpt.RUNS + llama3.RUNS + nemo.RUNS + gpu_runs.RUNS}

H100_500W = ("torchtitan on Grand Teton H100 at 500 W, held out from SUSTAINED_HOPPER's fit: its other six rows price "
             "within 14%, this one 31% fast: the 500 W cap's cube-root rule (x0.90, hardware.POWER_EXPONENT, from "
             "two datasheets' boost-clock peaks) is one suspect; Meta's own Llama 3 405B runs on 700 W H100s price "
             "within 10% (published_llama3.py)")
TP8_SMALL = ("torchtitan's vanilla TP 8 of 8K-token rows: its collectives are priced exposed, as the run had them, "
             "but its GEMMs (an eighth of each weight) at the large-shape efficiency")
# name -> (today's error, the suspected deciding assumption)
GAPS = {
    "Llama 2 70B FSDP sel mb1, 64 A100": (-0.467, "priced bound by its gathers: 70B's parameters at one GPU's NIC "
                                          "share (collectives.py) outlast a 4,096-token micro-batch's compute, "
                                          "where torchtitan measured it as fast as the mb2 run: here NCCL drove "
                                          "more than one NIC per GPU (every NIC: +28%)"),
    "Llama 3 8B FSDP8 TP8, 64 H100": (0.309, H100_500W + "; " + TP8_SMALL),
}


# MosaicML's MPT benchmarks (published_mpt.py), held out from every constant's fit: name -> (today's error, the
# suspected deciding assumption)
MPT_GAPS = {
    "MPT 70B 2K, 32 A100 80GB": (-0.423, "priced bound by its gathers, as Llama 2 70B mb1 (GAPS): ZeRO-3 re-gathers "
                                 "70B's parameters for each 4,096-token micro-batch (16 of them) at one GPU's NIC "
                                 "share, where the same model at micro-batch 8 on 64 GPUs is priced within 2%"),
    "MPT 7B 32K, 8 A100 80GB": (0.336, "attention is more than half of a 32K row's FLOPs, and MPT's kernel (llm-"
                                "foundry's flash_attn_triton, FlashAttention 1's Triton port) is priced as "
                                "FlashAttention-2. Priced as the port (attention 'triton': hardware."
                                "FLASH_TRITON_AMPERE, 0.42x FlashAttention-2) this row is -14.0% and the 8K row "
                                "-16.9%; priced as the port with MPT's element-wise ops as the single kernels they "
                                "are (LayerNorm, GELU; ALiBi inside the attention kernel: 'compiled'), -8.7% and "
                                "-6.9%, but the 2K rows then run +1% to +21% fast and the H100 rows have no figure "
                                "for the port (RESULTS.md, trials): bunsan's eager Llama block stands in for MPT's "
                                "leaner one and makes up for the slower kernel at 2K"),
}


# the ranked runs and the held-out ones: MPT's, Llama 3 405B's, NVIDIA's NeMo recipes, and bunsan's own on the
# first lent H100 (measured_gpu_runs.py)
PRICED = [r for r in pr.RUNS if r.ranked] + list(mpt.RUNS) + list(llama3.RUNS) + list(nemo.RUNS) + list(gpu_runs.RUNS)
PINNED = {**GAPS, **MPT_GAPS}


@pytest.mark.parametrize("run", [r for r in PRICED if r.name not in PINNED], ids=lambda r: r.name)
def test_published_layouts_are_priced_within_15_percent_of_measured(run):
    """Ranked runs and the held-out ones alike (MPT's: 17 of 19, median 6%; Llama 3 405B's: 3 of 3; NeMo's DGX H100
    recipes: 29 of 29, median 3%; bunsan's H100 runs: 4 of 4; fitted to nothing)."""
    r = pr.reproduce(run, search_too=False)
    assert abs(r.error) < 0.15, f"{run.name}: predicted {r.predicted:.4g} vs {run.measured} {run.unit}"


@pytest.mark.parametrize("name", list(PINNED))
def test_the_runs_outside_15_percent_stay_where_they_are(name):
    """Not the target: a pin. A change that brings one within 15% moves it out of GAPS (or MPT_GAPS); one that
    drifts fails."""
    today, why = PINNED[name]
    r = pr.reproduce(BY_NAME[name], search_too=False)
    assert abs(r.error - today) < 0.05, f"{name}: {r.error:+.1%}, was {today:+.1%} ({why})"
    if abs(r.error) < 0.15:
        pytest.fail(f"{name} is now within 15% ({r.error:+.1%}): move it out of GAPS / MPT_GAPS")


def test_mpt_priced_as_what_ran_fits_long_rows_and_overshoots_short_ones():
    """The trial MPT_GAPS cites: MPT's A100 rows priced with the kernel they ran (attention 'triton') and their
    element-wise ops as the single kernels llm-foundry's block runs (compiled). The 8K and 32K rows come within
    10%; the 2K rows run fast, the 13B one past 15%: what MPT spends at 2K beyond its GEMMs, kernel and bytes is
    not priced. Pinned so that the claim stays true; the rows stay priced as today's until it is found."""
    def error(name: str) -> float:
        run = dataclasses.replace(BY_NAME[name], attention="triton", compiled=True)
        return pr.reproduce(run, search_too=False).error
    today = {"MPT 7B 32K, 8 A100 80GB": -0.087, "MPT 7B 8K, 8 A100 80GB": -0.069, "MPT 13B 2K, 8 A100 80GB": 0.208,
             "MPT 1B 2K, 8 A100 80GB": 0.079}
    for name, was in today.items():
        assert abs(error(name) - was) < 0.03, f"{name}: {error(name):+.1%}, was {was:+.1%}"


@pytest.mark.parametrize("run", llama3.RUNS, ids=lambda r: r.name)
def test_llama3s_virtual_stages_are_the_planners_cheapest(run):
    """Meta published no virtual-stage count: each Llama 3 405B row is priced at v = 4 (published_llama3.py) because
    it is the cheapest of the three that 126 layers over 16 stages allow, not because it fits best. A cost-model
    change that makes another v cheaper fails here, to re-price the rows at it."""
    def step(v: int) -> float:
        return pr.price(llama3.llama3_run(run.gpus, run.layout.cp, run.seq_len, run.measured, v)).total
    assert min((1, 2, 4), key=step) == run.layout.virtual_stages == llama3.VIRTUAL_STAGES


def test_async_tp_speedup_is_priced_as_an_upper_bound():
    """torchtitan's async TP (published_runs.ASYNC_TP) ran 1.09x and 1.10x its vanilla TP; priced with overlap "tp"
    (every TP collective hidden behind the compute beside it, one block's share exposed) 1.23x and 1.31x. An
    upper bound: async TP cuts each matmul into one chunk per rank, which runs slower than the whole, and its
    copies share the SMs; neither is priced (suspected, not measured). Pinned within 0.05 of today's figures."""
    today = {"Llama 3 70B FSDP32 TP8, 256 H100": 1.233, "Llama 3 8B FSDP8 TP8, 64 H100": 1.309}
    for name, (measured, speedup) in pr.async_tp_speedups().items():
        assert speedup >= measured, f"{name}: {speedup:.3f} vs measured {measured:.3f}"
        assert abs(speedup - today[name]) < 0.05, f"{name}: {speedup:.3f}, was {today[name]}"


def test_megatron_cores_tp8_rows_need_the_overlaps_its_readme_ran():
    """Megatron-Core's README ran with its communication overlapped (--tp-comm-overlap, --overlap-grad-reduce,
    --overlap-param-gather: published_runs.MCORE_OVERLAPS), which bunsan's engine does not do. Priced with them
    its TP 8 rows land within 15%; priced as bunsan's engine (every collective exposed), the 32B row is over
    25% slow."""
    run = BY_NAME["GPT 32B, 384 H100"]
    assert abs(pr.reproduce(run, search_too=False).error) < 0.15
    plain = pr.reproduce(dataclasses.replace(run, overlap=()), search_too=False)
    assert plain.error < -0.25, f"{plain.error:+.1%}"


def test_the_hopper_sustained_fraction_is_the_fit_to_megatron_core():
    """hardware.SUSTAINED_HOPPER is the least-squares fit (log errors, to 0.01) of Megatron-Core's nine H100
    runs: a cost-model change that moves their fit fails here, to be re-fitted (and the held-out torchtitan
    runs re-checked) rather than left stale."""
    runs = [r for r in pr.RUNS if r.group == "Megatron-Core H100 2024"]
    saved = hardware.GPUS["h100"]

    def misfit(fraction: float) -> float:
        hardware.GPUS["h100"] = dataclasses.replace(saved, sustained_fraction=fraction)
        try:
            return sum(math.log(1 + pr.reproduce(r, search_too=False).error) ** 2 for r in runs)
        finally:
            hardware.GPUS["h100"] = saved
    grid = [round(0.70 + i / 100, 2) for i in range(31)]
    assert min(grid, key=misfit) == hardware.SUSTAINED_HOPPER
    assert all(abs(pr.reproduce(r, search_too=False).error) < 0.15 for r in runs)


# Every published layout more than 5% behind the planner's first choice: the term `plan --explain` says decides
# it ("memory" where the layout is ranked after those that fit), and the assumption behind that term
TP_EXPOSED = ("tensor-parallel collectives priced on the critical path, never overlapped (cost.py), at the node's "
              "NVLink bandwidth: the first choice halves TP and pays in pipeline stages instead")
GATHERS_ONE_NIC = ("ZeRO-3's all-gathers and reduce-scatters at one GPU's share of the node's NICs (collectives.py; "
                   "DGX A100's eight HDR links assumed) outlast the compute they hide behind; the first choice's "
                   "TP 2 halves the bytes each GPU gathers")
NO_RECOMPUTE_FITS = ("bunsan's memory estimate fits the step without recompute on the 96 GiB board, where torchtitan "
                     "ran per-op selective checkpointing (its rerun matmuls priced by sac_recompute)")
DP_EXPOSED = ("the gradients' reduce, overlapped (--overlap-grad-reduce), hides only behind the last micro-batch's "
              "backward: one 4,096-token row (the README does not give the micro-batch: 1 assumed, published_runs.py) "
              "leaves it a quarter of the window the first choice's micro-batches of 4 do")
BUBBLE_1F1B = ("the published layout priced as 1F1B without virtual stages (the README gives none: "
               "published_runs.py), whose bubble (p-1)/(m+p-1) the first choice cuts with fewer stages of 4 "
               "interleaved chunks each")
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
    "GPT 70B, 768 H100": ("dp_comm", DP_EXPOSED),
    "GPT 119B, 1536 H100": ("bubble", BUBBLE_1F1B),
    "GPT 177B, 2304 H100": ("bubble", BUBBLE_1F1B),
    "GPT 314B, 3072 H100": ("bubble", BUBBLE_1F1B),
    "GPT 462B, 6144 H100": ("bubble", BUBBLE_1F1B),
}


@dataclasses.dataclass(frozen=True)
class Searched:
    """What the tests read of a run's search. (The search itself, thousands of priced layouts, is let go: kept
    for all 29 runs it held about 2 GB of the test process's memory to the end of the suite.)"""
    rank: int | None
    ranked: int
    behind_first: float
    first: object
    said: str             # `plan --explain`'s decided_by for the published layout


@functools.lru_cache(maxsize=None)
def searched(name: str) -> Searched:
    """`name`'s search, once per session (the tests below share it)."""
    r = pr.reproduce(BY_NAME[name])
    return Searched(r.rank, r.ranked, r.behind_first, r.first, pr.explain_published(BY_NAME[name], r.plan).decided_by())


@pytest.mark.parametrize("name", [r.name for r in pr.RUNS if r.ranked])
def test_plan_explain_names_the_term_that_puts_each_published_layout_behind(name):
    """Every ranked run: within 5% of the first choice, or in DECIDED_BY with the term `plan --explain` names."""
    r = searched(name)
    said = r.said
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
