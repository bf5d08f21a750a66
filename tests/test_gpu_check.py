"""`scripts/gpu-check --dry-run`: the GPU self-check, end to end on the CPU, so that it cannot rot between the
rare runs on a lent GPU machine. Every row the GPU run reports must be present here and pass; the expected
rows are listed in this file (not read from the script), so a row the script stopped running fails the test.
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
DRY_RUN_TIMEOUT_S = 290          # above the dry run's own limit (260 s): a slow machine gets its report, not a kill

EXPECTED = {
    "preflight": ["environment"],
    "single": ["bf16 zero0", "bf16 zero1", "bf16 zero2", "bf16 zero3", "bf16 zero3 offload cpu",
               "bf16 zero3 offload nvme", "bf16 activation checkpointing", "bf16 lora", "fp16 dynamic loss scale",
               "offload_states zero3 (DeepSpeed's)"],
    "syncs": ["nccl zero0", "nccl zero1", "nccl zero2", "nccl zero3", "nccl zero3 offload cpu"],
    "shared_gpu": ["gloo dp (zero0)", "gloo zero1", "gloo zero2", "gloo zero3", "gloo tp2", "gloo tp2 sp",
                   "gloo pp2 gpipe", "gloo pp2 1f1b", "gloo zero3 checkpoint save/load"],
    "inference": ["generate --device-map auto (command)", "generate tokens/s", "serve tokens/s"],
    "throughput": ["matmul reference rate", "bunsan eager", "bunsan eager checkpointing", "torch eager (autocast)",
                   "bunsan compiled", "torch compiled (autocast)", "bunsan compiled checkpointing",
                   "memory bunsan eager", "memory bunsan eager checkpointing", "memory bunsan compiled",
                   "memory bunsan compiled checkpointing"],
    "kernels": ["gemm by shape", "flash attention by length", "transformers blocks", "compiled recompute memory",
                "element-wise passes"],
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=DRY_RUN_TIMEOUT_S)
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}\n{log[-6000:]}"
    return json.loads((out / "gpu-check.json").read_text())


def _rows(report) -> dict:
    return {(r["section"], r["name"]): r for r in report["rows"]}


@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 20)
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
    for key in ("date", "commit", "machine", "elapsed_s"):
        assert report[key], key
    assert report["machine"]["torch"] and "python" in report["machine"]


def test_parity_rows_compare_losses_that_move(report):
    rows = _rows(report)
    for name in EXPECTED["single"] + EXPECTED["shared_gpu"]:
        section = "single" if name in EXPECTED["single"] else "shared_gpu"
        n = rows[(section, name)]["numbers"]
        assert len(n["losses"]) == len(n["reference"]) >= 3, name
        assert n["max_rel_diff"] <= n["rtol"] < n["reference_moved"], (name, n)
        assert all(math.isfinite(x) for x in n["losses"]), name


def test_every_shared_gpu_row_checked_tensors_on_both_ranks(report):
    rows = _rows(report)
    for name in EXPECTED["shared_gpu"]:
        n = rows[("shared_gpu", name)]["numbers"]
        assert n["backend"] == "gloo" and n["world"] == 2, name
        assert len(n["tensors_checked"]) == 2 and min(n["tensors_checked"]) > 0, (name, n["tensors_checked"])
    ckpt = rows[("shared_gpu", "gloo zero3 checkpoint save/load")]["numbers"]
    assert ckpt["resumed_rel_diff"] <= 1e-5 and ckpt["resumed_step"] == len(ckpt["losses"])
    assert rows[("shared_gpu", "gloo tp2")]["numbers"]["layout"] == {"dp": 1, "tp": 2, "pp": 1}
    assert rows[("shared_gpu", "gloo pp2 1f1b")]["numbers"]["layout"] == {"dp": 1, "tp": 1, "pp": 2}


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


def test_inference_rows_generate_and_serve(report):
    rows = _rows(report)
    placed = rows[("inference", "generate --device-map auto (command)")]["numbers"]["placement"]
    assert list(placed) == ["cpu"] and placed["cpu"][0] == 4 + 3      # tiny: 4 blocks + embedding, norm, head
    assert rows[("inference", "generate tokens/s")]["numbers"]["tokens_per_s"] > 0
    serve = rows[("inference", "serve tokens/s")]["numbers"]
    assert serve["tokens_per_s"] > 0 and serve["health"]["status"] == "ok"



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


def test_a_dry_run_fails_when_a_row_is_skipped(tmp_path):
    """A time limit too short to start any section: the section is recorded as skipped, and in a dry run a skip
    fails the run (exit 1), so a dry run that silently ran nothing cannot pass."""
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--sections", "single", "--time-limit", "5", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    rep = json.loads((tmp_path / "gpu-check.json").read_text())
    assert rep["passed"] is False and rep["counts"]["skipped"] == 1


def test_a_crashed_section_fails_its_rows(tmp_path, on_path):
    from benchmarks.gpu_check.__main__ import _section
    with open(tmp_path / "log", "w") as log:
        rows, info = _section("no_such_section", time.time() + 60, True, tmp_path, log)
    assert info["rc"] != 0 and [r["status"] for r in rows] == ["fail"]
    assert "ModuleNotFoundError" in rows[0]["why"] or "No module" in rows[0]["why"]
