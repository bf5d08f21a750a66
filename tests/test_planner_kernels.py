"""`bunsan plan --kernels FILE`: GEMMs priced at the rate measured for their shape, flash attention on its measured
curve, from benchmarks/bench_kernels.py's JSON or scripts/gpu-check's gpu-check.json. The files here are written
by the test in those formats (no GPU here): what is checked is that the measured figures, and only they, move
the prices, and that a file from another board or from a CPU is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bunsan.cli.main import main
from bunsan.estimator.hardware import gpu_spec
from bunsan.estimator.layout import Layout
from bunsan.planner import compute
from bunsan.planner import constants as K
from bunsan.planner.kernels import attach, read_kernels

REFERENCE = 790.0                       # TFLOP/s of the 8192^3 product (the H100's measured one)
SHAPES = [(2048, 2048), (8192, 8192), (8192, 1024)]
# fraction of the reference by tokens: short GEMMs slower; (8192, 1024), a TP 8 slice, slower still
FRACTION = {256: 0.4, 1024: 0.7, 4096: 1.0, 16384: 1.0}
FLASH = {512: 200.0, 2048: 300.0, 16384: 400.0}     # causal forward + backward TFLOP/s by length


def bench_json(device="NVIDIA H100 80GB HBM3") -> dict:
    gemm = [{"kind": kind, "m": m, "k": k, "n": n, "seconds": 1.0,
             "tflops": REFERENCE * f * (0.5 if (k, n) == (8192, 1024) else 1.0)}
            for k, n in SHAPES for m, f in FRACTION.items() for kind in ("forward", "dgrad", "wgrad")]
    flash = [{"kind": "causal", "seq": s, "batch": 1, "seconds": 1.0, "tflops": t} for s, t in FLASH.items()]
    flash.append({"kind": "chunk", "rows": 512, "keys": 16384, "seconds": 1.0, "tflops": 100.0})
    return {"device": device, "dtype": "bf16", "reference": {"m": 8192, "tflops": REFERENCE}, "gemm": gemm,
            "flash": flash}


@pytest.fixture
def kernels_file(tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(bench_json()))
    return path


def test_the_measured_curves_are_read_by_shape_and_length(kernels_file):
    k = read_kernels(kernels_file)
    assert k.gemm_factor(256, 2048, 2048) == pytest.approx(0.4)
    assert k.gemm_factor(512, 2048, 2048) == pytest.approx(0.55)          # halfway in log2 between 256 and 1024
    assert k.gemm_factor(64, 2048, 2048) == pytest.approx(0.4)            # flat past the ends
    assert k.gemm_factor(1 << 20, 2048, 2048) == pytest.approx(1.0)
    assert k.gemm_factor(16384, 8192, 1536) == pytest.approx(0.5)         # nearest measured (k, n): the TP slice
    assert k.gemm_factor(16384, 7000, 7000) == pytest.approx(1.0)
    assert k.flash_at(16384) == pytest.approx(1.0) and k.flash_at(512) == pytest.approx(0.5)
    assert k.flash_tflops == 400.0 and k.reference_tflops == REFERENCE


def test_a_gemm_and_flash_attention_are_priced_at_the_measured_rates(kernels_file):
    plain = gpu_spec("h100")
    measured = attach(plain, read_kernels(kernels_file))
    assert measured.matmul_fraction == pytest.approx(REFERENCE / 989) and measured.flash_fraction == \
        pytest.approx(400 / 989)
    big, short = (16384, 8192, 8192), (256, 8192, 8192)
    same_scale = dataclasses.replace(plain, matmul_fraction=measured.matmul_fraction)
    for shape, factor in ((big, 1.0), (short, 0.4)):
        flops = 2.0 * shape[0] * shape[1] * shape[2]
        want = flops / (same_scale.sustained_flops("bf16") * same_scale.gemm_scale * K.GEMM_EFFICIENCY * factor)
        got = compute.gemm(*shape, measured, "bf16", 2, K.GEMM_EFFICIENCY)
        assert got == pytest.approx(max(want, compute.gemm(*shape, same_scale, "bf16", 2, K.GEMM_EFFICIENCY)))
    assert compute.flash_at(512, measured) == pytest.approx(0.5)
    assert compute.flash_at(512, plain) == pytest.approx(K.FLASH_BY_CHUNK[0][1])
    lay = Layout(micro_batch=1, seq_len=2048, precision="bf16")
    from bunsan.models.presets import build_config
    model = build_config("1b")
    slower = compute.block_time(model, lay, measured, K.GEMM_EFFICIENCY).forward
    assert slower > compute.block_time(model, lay, same_scale, K.GEMM_EFFICIENCY).forward   # 2048-token GEMMs < 1


@pytest.mark.e2e
def test_plan_with_kernels_prices_by_them_and_says_so(kernels_file, capsys):
    argv = ["plan", "--model", "1b", "--gpus", "8", "--gpu", "h100", "--seq-len", "2048", "--global-batch", "64",
            "--json", "--top", "1"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv + ["--kernels", str(kernels_file)]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert plain["pricing"]["measured_kernels"] is None
    said = measured["pricing"]["measured_kernels"]
    assert said["reference_tflops"] == REFERENCE and said["source"] == str(kernels_file)
    assert measured["ranked"][0]["step_seconds"] != plain["ranked"][0]["step_seconds"]
    assert main(argv[:-3] + ["--kernels", str(kernels_file)]) == 0        # the table's assumptions say so
    assert "rate measured on this board (--kernels" in " ".join(capsys.readouterr().out.split())


def test_gpu_check_json_is_read_and_other_boards_and_cpus_are_refused(tmp_path, capsys):
    bench = bench_json()
    check = {"machine": {"gpu": bench["device"]}, "rows": [
        {"section": "kernels", "name": "gemm by shape",
         "numbers": {"reference_tflops": REFERENCE, "gemms": bench["gemm"]}},
        {"section": "kernels", "name": "flash attention by length", "numbers": {"flash": bench["flash"]}}]}
    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps(check))
    assert read_kernels(path).gemm_factor(256, 2048, 2048) == pytest.approx(0.4)
    argv = ["plan", "--model", "1b", "--gpus", "8", "--seq-len", "2048", "--kernels", str(path)]
    assert main(argv + ["--gpu", "a100"]) == 2
    err = capsys.readouterr().err
    assert "measured on NVIDIA H100 80GB HBM3" in err and "--gpu h100" in err
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(bench_json(device="cpu")))
    assert main(argv[:-1] + [str(cpu), "--gpu", "h100"]) == 2
    assert "not a GPU" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3"}))
    assert main(argv[:-1] + [str(empty), "--gpu", "h100"]) == 2
    assert "no GEMM measurements" in capsys.readouterr().err
