"""`scripts/gpu-check --dry-run`: the GPU self-check, end to end on the CPU, so that it cannot rot between the
rare runs on a lent GPU machine. Every row the GPU run reports must be present here and pass; the expected
rows are listed in this file (not read from the script), so a row the script stopped running fails the test.

The dry run is one command run as its users run it (sections in processes of their own, a server, `bunsan
generate`), shared by every test that reads its report: the end-to-end tier. It has no time budget (a loaded
machine makes it slow, never skipped); the budget of a real run and the verdict on a skip are checked without
running a section, in the fast tier.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
# A ceiling that only catches a hang (the dry run has no time limit; its sections' own ceiling is 900 s each).
DRY_RUN_HANG_S = 1800


def dry_run(test):
    """A test of the dry run's report: end-to-end tier, and a ceiling over the report's making (the setup of
    whichever such test runs first)."""
    return pytest.mark.e2e(pytest.mark.timeout(DRY_RUN_HANG_S + 60)(test))


EXPECTED = {
    "preflight": ["environment"],
    "single": ["bf16 zero0", "bf16 zero1", "bf16 zero2", "bf16 zero3", "bf16 zero3 offload cpu",
               "bf16 zero3 offload nvme", "bf16 activation checkpointing", "bf16 lora", "fp16 dynamic loss scale",
               "offload_states zero3 (DeepSpeed's)"],
    "syncs": ["nccl zero0", "nccl zero1", "nccl zero2", "nccl zero3", "nccl zero3 offload cpu"],
    "shared_gpu": ["gloo dp (zero0)", "gloo zero1", "gloo zero2", "gloo zero3", "gloo tp2", "gloo tp2 sp",
                   "gloo pp2 gpipe", "gloo pp2 1f1b", "gloo ep2 moe zero2", "gloo zero3 checkpoint save/load"],
    "inference": ["generate --device-map auto (command)", "generate tokens/s", "serve tokens/s"],
    "throughput": ["matmul reference rate", "bunsan eager", "bunsan eager checkpointing", "torch eager (autocast)",
                   "bunsan compiled", "torch compiled (autocast)", "bunsan compiled checkpointing",
                   "memory bunsan eager", "memory bunsan eager checkpointing", "memory bunsan compiled",
                   "memory bunsan compiled checkpointing"],
    "kernels": ["gemm by shape", "flash attention by length", "transformers blocks", "compiled recompute memory",
                "element-wise passes", "moe block grouped_mm"],
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=DRY_RUN_HANG_S)
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}\n{log[-6000:]}"
    return json.loads((out / "gpu-check.json").read_text())


def _rows(report) -> dict:
    return {(r["section"], r["name"]): r for r in report["rows"]}


@dry_run
def test_every_row_is_there_and_passed(report):
    rows = _rows(report)
    expected = {(s, n) for s, names in EXPECTED.items() for n in names}
    missing = sorted(expected - set(rows))
    assert not missing, f"rows not reported: {missing}"
    bad = {k: (r["status"], r["why"]) for k, r in rows.items() if r["status"] != "pass"}
    assert not bad, f"rows that did not pass: {bad}"
    assert report["dry_run"] is True and report["passed"] is True
    assert report["counts"] == {"pass": len(rows), "fail": 0, "skipped": 0}
    assert {s["name"] for s in report["sections"]} == set(EXPECTED) - {"preflight"}
    assert all(s["rc"] == 0 and not s["timed_out"] for s in report["sections"])
    # no budget anywhere in a dry run: none for the check, none for a section
    assert report["time_limit_s"] is None and all(s["budget_s"] is None for s in report["sections"])
    for key in ("date", "commit", "machine", "elapsed_s"):
        assert report[key], key
    assert report["machine"]["torch"] and "python" in report["machine"]


@dry_run
def test_parity_rows_compare_losses_that_move(report):
    rows = _rows(report)
    for name in EXPECTED["single"] + EXPECTED["shared_gpu"]:
        section = "single" if name in EXPECTED["single"] else "shared_gpu"
        n = rows[(section, name)]["numbers"]
        assert len(n["losses"]) == len(n["reference"]) >= 3, name
        assert n["max_rel_diff"] <= n["rtol"] < n["reference_moved"], (name, n)
        assert all(math.isfinite(x) for x in n["losses"]), name


@dry_run
def test_every_shared_gpu_row_checked_tensors_on_both_ranks(report):
    rows = _rows(report)
    for name in EXPECTED["shared_gpu"]:
        n = rows[("shared_gpu", name)]["numbers"]
        assert n["backend"] == "gloo" and n["world"] == 2, name
        assert len(n["tensors_checked"]) == 2 and min(n["tensors_checked"]) > 0, (name, n["tensors_checked"])
    ckpt = rows[("shared_gpu", "gloo zero3 checkpoint save/load")]["numbers"]
    assert ckpt["resumed_rel_diff"] <= 1e-5 and ckpt["resumed_step"] == len(ckpt["losses"])
    assert rows[("shared_gpu", "gloo tp2")]["numbers"]["layout"] == {"dp": 1, "tp": 2, "pp": 1, "ep": 1}
    assert rows[("shared_gpu", "gloo pp2 1f1b")]["numbers"]["layout"] == {"dp": 1, "tp": 1, "pp": 2, "ep": 1}
    assert rows[("shared_gpu", "gloo ep2 moe zero2")]["numbers"]["layout"] == {"dp": 2, "tp": 1, "pp": 1, "ep": 2}


@dry_run
def test_sync_rows_count_the_steps_host_reads(report):
    rows = _rows(report)
    for name in EXPECTED["syncs"]:
        n = rows[("syncs", name)]["numbers"]
        per_step = n["syncs_per_step"]
        assert len(per_step) == n["counted_steps"] >= 1, name
        assert all(1 <= k <= n["limit_per_step"] for k in per_step), (name, per_step)
        assert sum(n["sync_sources"].values()) > 0
        # the step's one read at the optimizer boundary is among what was counted, and named
        assert any(w.startswith("bunsan/engine/engine.py") for w in n["sync_sources"]), n["sync_sources"]


@dry_run
def test_throughput_and_memory_rows_have_their_figures(report):
    rows = _rows(report)
    assert rows[("throughput", "matmul reference rate")]["numbers"]["flops_per_s"] > 0
    eager = rows[("throughput", "bunsan eager")]["numbers"]
    assert eager["tried"], "the dry run's simulated out-of-memory did not make the search step down"
    assert eager["micro_batch"] < eager["tried"][0][0]
    for name in EXPECTED["throughput"][1:7]:
        n = rows[("throughput", name)]["numbers"]
        assert n["tokens_per_s"] > 0 and n["micro_batch"] >= 1 and n["mfu"] is None, (name, n)   # no CPU peak
    for name in ("torch eager (autocast)", "torch compiled (autocast)"):
        assert rows[("throughput", name)]["numbers"]["target_bunsan_vs_torch"]["ratio"] > 0
    for name in EXPECTED["throughput"][7:]:
        n = rows[("throughput", name)]["numbers"]
        assert n["measured"] > 0 and n["predicted"] > 0 and n["ratio"] == pytest.approx(n["measured"] / n["predicted"])
        assert isinstance(n["target"]["met"], bool)


@dry_run
def test_inference_rows_generate_and_serve(report):
    rows = _rows(report)
    placed = rows[("inference", "generate --device-map auto (command)")]["numbers"]["placement"]
    assert list(placed) == ["cpu"] and placed["cpu"][0] == 4 + 3      # tiny: 4 blocks + embedding, norm, head
    assert rows[("inference", "generate tokens/s")]["numbers"]["tokens_per_s"] > 0
    serve = rows[("inference", "serve tokens/s")]["numbers"]
    assert serve["tokens_per_s"] > 0 and serve["health"]["status"] == "ok"



@dry_run
def test_kernel_rows_carry_the_figures_the_planner_is_fitted_to(report):
    rows = _rows(report)
    gemm = rows[("kernels", "gemm by shape")]["numbers"]
    assert {g["kind"] for g in gemm["gemms"]} == {"forward", "dgrad", "wgrad"}
    assert all(g["tflops"] > 0 and g["of_reference"] > 0 and {"m", "k", "n"} <= set(g) for g in gemm["gemms"])
    flash = rows[("kernels", "flash attention by length")]["numbers"]["flash"]
    assert {f["kind"] for f in flash} == {"causal", "chunk"} and all(f["seconds"] > 0 for f in flash)
    passes = rows[("kernels", "element-wise passes")]["numbers"]
    for op in ("rms_norm", "swiglu", "rope"):
        for mode in ("eager", "compiled"):
            assert passes[f"{op} {mode}"]["forward_passes"] > 0 and passes[f"{op} {mode}"]["train_s"] > 0
    blocks = rows[("kernels", "transformers blocks")]["numbers"]["of_bunsan_llama"]
    assert blocks["bunsan Llama"] == 1.0 and {"transformers Qwen2", "transformers Mistral"} <= set(blocks)
    moe = rows[("kernels", "moe block grouped_mm")]["numbers"]
    assert moe["out_rel_diff"] < 5e-2 and set(moe["tokens_per_s"]) == {"grouped_mm", "loop"}
    modes = rows[("kernels", "compiled recompute memory")]["numbers"]["modes"]
    assert set(modes) == {"eager recompute", "compiled recompute", "compile inside the checkpoint"}
    assert all(m["saved_by_hooks"] > 0 for m in modes.values())

# -- the verdict logic, without running sections ------------------------------------------------------------
@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))        # benchmarks/ is not installed: import it from the checkout


def test_loss_comparison_fails_on_a_wrong_step_a_nan_and_an_insensitive_reference(on_path):
    from benchmarks.gpu_check.common import Row, RowFailed, compare_losses
    ref = [5.6, 5.0, 4.5]
    compare_losses(Row("s", "ok"), [5.6, 5.01, 4.51], ref, 3e-2, "ref")
    for got, want in (([5.6, 5.0, 4.0], ref), ([5.6, float("nan"), 4.5], ref), ([5.6, 5.6, 5.6], [5.6, 5.6, 5.6]),
                      ([5.6, 5.0], ref)):
        with pytest.raises(RowFailed):
            compare_losses(Row("s", "bad"), got, want, 3e-2, "ref")


def test_only_a_real_run_has_a_budget_and_a_skip_fails_a_dry_run(tmp_path, on_path):
    """What a budget does, without running a section. A real run (a lent GPU's lease ends hard) gives each
    section its budget within the time limit, skips a section the limit cannot hold and a row its section's
    budget cannot, and passes with a skipped row (the rest stands). A dry run has no budget, runs every row
    whatever it needs, and fails on any skip: a dry run that silently ran nothing cannot pass."""
    from benchmarks.gpu_check.__main__ import GRACE_S, _deadline, _not_started, _passed, main
    from benchmarks.gpu_check.common import Row, Section
    now, ok = 1000.0, Row("preflight", "environment")
    assert _deadline(45, now + 460, now) == now + 45 and _deadline(None, now + 460, now) == now + 460 - GRACE_S
    spent = _deadline(45, now + 5, now)
    assert _not_started("single", ok, spent, now, 460).status == "skipped"
    assert _not_started("single", ok, _deadline(45, now + 460, now), now, 460) is None
    assert _not_started("single", ok, None, now, None) is None                       # a dry run's section
    broken = Row("preflight", "environment", status="fail", why="no CUDA")
    assert _not_started("single", broken, None, now, None).status == "fail"
    skipped = {"pass": 3, "fail": 0, "skipped": 1}
    assert not _passed(skipped, dry_run=True) and _passed(skipped, dry_run=False)
    assert not _passed({"pass": 3, "fail": 1, "skipped": 0}, dry_run=False)
    ran = []
    real = Section("single", str(tmp_path / "real.jsonl"), time.time() - 1.0, dry_run=False)     # budget spent
    assert real.run("row", lambda row: ran.append("real"), 5.0).status == "skipped" and not ran
    dry = Section("single", str(tmp_path / "dry.jsonl"), None, dry_run=True)
    assert dry.run("row", lambda row: ran.append("dry"), 1e9).status == "pass" and ran == ["dry"]
    assert main(["--dry-run", "--time-limit", "5", "--out", str(tmp_path)]) == 2      # refused: no budget there


def test_a_crashed_section_fails_its_rows(tmp_path, on_path):
    from benchmarks.gpu_check.__main__ import _section
    with open(tmp_path / "log", "w") as log:
        rows, info = _section("no_such_section", None, True, tmp_path, log)
    assert info["rc"] != 0 and [r["status"] for r in rows] == ["fail"]
    assert "ModuleNotFoundError" in rows[0]["why"] or "No module" in rows[0]["why"]
