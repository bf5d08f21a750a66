"""The GPU table's form factor, power limit and SMs, and eager against compiled element-wise work."""

import json

import pytest

from bunsan.cli.main import main
from bunsan.config.root import Config
from bunsan.estimator.hardware import GPUS, gpu_spec, intra_link, parse_gpu_spec
from bunsan.estimator.layout import Layout
from bunsan.models.presets import get_preset
from bunsan.planner import compute, constants


def test_every_datasheet_gpu_has_its_form_power_and_sms_and_a_pcie_card_talks_over_pcie():
    for name, gpu in GPUS.items():
        if name != "cpu":
            assert gpu.form in ("SXM", "PCIe") and gpu.power_w > 0 and gpu.sms > 0, name
    assert intra_link(gpu_spec("h100")).name == "nvlink" and intra_link(gpu_spec("a100")).name == "nvlink3"
    for card in ("h100-pcie", "a100-pcie", "l40s", "a10", "rtx4090"):
        assert intra_link(gpu_spec(card)).name == "pcie", card
    # the names torch.cuda.get_device_name() gives
    assert gpu_spec("NVIDIA H100 PCIe").name == "h100-pcie" and gpu_spec("NVIDIA A100 80GB PCIe").name == "a100-pcie"
    pcie, sxm = gpu_spec("h100-pcie"), gpu_spec("h100")
    assert pcie.flops("bf16") < sxm.flops("bf16") and pcie.power_w < sxm.power_w and pcie.sms < sxm.sms


def test_gpu_spec_takes_form_power_and_sms_and_names_a_bad_one():
    gpu = parse_gpu_spec("a100,form=PCIe,power=250W,sms=108")
    assert (gpu.form, gpu.power_w, gpu.sms) == ("PCIe", 250, 108) and intra_link(gpu).name == "pcie"
    with pytest.raises(ValueError, match=r"form='OAM': SXM \(an NVLink baseboard\) or PCIe"):
        parse_gpu_spec("a100,form=OAM")
    with pytest.raises(ValueError, match=r"power='lots': a positive whole number, e.g. power=400W"):
        parse_gpu_spec("a100,power=lots")


def test_eager_pays_each_elementwise_op_a_pass_and_compiled_fuses_them():
    """The difference is the counted passes, exactly: 42 against 12 over the hidden state, rotary's 10 per q/k
    element (fused into the 12), SwiGLU's 5 against 3."""
    c, h100 = get_preset("7b"), gpu_spec("h100")
    lay = Layout(tp=2, seq_len=4096, micro_batch=1)
    eager, fused = (compute.block_time(c, lay, h100, 0.8, compiled=k) for k in (False, True))
    tokens, h, t, d = 4096, c.hidden_size, 2, c.head_dim
    passes = ((constants.EAGER_HIDDEN_PASSES - constants.HIDDEN_PASSES) * tokens * h
              + constants.EAGER_ROPE_PASSES * tokens * (c.num_attention_heads + c.num_key_value_heads) * d / t
              + (constants.EAGER_MLP_ACT_PASSES - constants.MLP_ACT_PASSES) * tokens * c.intermediate_size / t)
    assert eager.forward - fused.forward == pytest.approx(compute.streamed(passes * 2, h100))
    eager_elementwise = (eager.forward - fused.forward) + compute.streamed(
        (constants.HIDDEN_PASSES * tokens * h + constants.MLP_ACT_PASSES * tokens * c.intermediate_size / t) * 2, h100)
    assert eager.backward == pytest.approx(constants.BACKWARD_FACTOR * (eager.forward - eager_elementwise)
                                           + constants.EAGER_BACKWARD_FACTOR * eager_elementwise)
    assert fused.backward == pytest.approx(constants.BACKWARD_FACTOR * fused.forward)


def test_plan_compile_prices_fused_ops_and_writes_the_compile_it_priced(tmp_path, capsys):
    args = ["plan", "--model", "1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "16", "--zero-stages",
            "1", "--recompute", "none", "--top", "1", "--json"]
    eager = json.loads((main(args), capsys.readouterr().out)[1])
    fused = json.loads((main(args + ["--compile"]), capsys.readouterr().out)[1])
    assert eager["pricing"]["compiled"] is False and fused["pricing"]["compiled"] is True
    first = [r["ranked"][0]["step_seconds"] for r in (eager, fused)]
    assert first[0]["total"] > first[1]["total"]
    assert "eager (each op a pass over HBM" in first[0]["assumptions"][0]
    assert "compiled (torch.compile fuses them" in first[1]["assumptions"][0]
    out = tmp_path / "best.json"
    assert main(args[:-1] + ["--compile", "--output", str(out)]) == 0
    assert Config.load(out).train.compile is True


def test_cudnn_attention_is_priced_at_its_hopper_figure_and_refused_where_unmeasured(capsys, tmp_path):
    """`--attention cudnn` (Transformer Engine's kernel on Hopper) runs the attention core at the FlashAttention-3
    paper's cuDNN figure and curve; on a GPU without that figure it is a clear error, not FlashAttention-2's
    figure under another name."""
    from bunsan.estimator import hardware
    c, h100 = get_preset("1b"), gpu_spec("h100")
    assert hardware.FLASH_CUDNN_HOPPER * 989 == pytest.approx(522) and h100.cudnn_flash_fraction is not None
    for seq, curves in ((16384, 1.0), (2048, 0.90 / 0.83)):     # CUDNN_BY_CHUNK over FLASH_BY_CHUNK at 2k
        lay = Layout(seq_len=seq, micro_batch=1)
        fa2, cudnn = (compute.block_time(c, lay, h100, 0.8, attention=k).attention_forward for k in ("flash", "cudnn"))
        assert fa2 / cudnn == pytest.approx(hardware.FLASH_CUDNN_HOPPER / hardware.FLASH_HOPPER * curves, rel=1e-6)
    args = ["plan", "--model", "1b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "8", "--zero-stages", "1",
            "--recompute", "none", "--top", "1", "--json", "--attention", "cudnn"]
    assert main(args) == 0
    assumptions = json.loads(capsys.readouterr().out)["ranked"][0]["step_seconds"]["assumptions"][0]
    assert "cuDNN's fused kernel's 52.8% of the peak" in assumptions and "CUDNN_BY_CHUNK" in assumptions
    # a config written from it runs PyTorch's SDPA: said, not silently taken for the priced kernel
    assert main(args[:-3] + ["--attention", "cudnn", "--output", str(tmp_path / "best.json")]) == 0
    assert "bunsan trains with PyTorch's scaled_dot_product_attention" in capsys.readouterr().out
    assert main(args[:-3] + ["--gpu", "a100", "--attention", "cudnn"]) != 0
    assert "attention 'cudnn' has no measured figure on a100" in capsys.readouterr().err
    with pytest.raises(ValueError, match="use attention 'flash'"):
        compute.block_time(c, Layout(seq_len=2048), gpu_spec("a100"), 0.8, attention="cudnn")


def test_triton_attention_is_priced_at_its_a100_figure_and_refused_where_unmeasured(capsys):
    """`--attention triton` (FlashAttention's Triton port: llm-foundry's attn_impl triton) runs the attention core
    at the FlashAttention-2 paper's A100 figure and curve for the port; off Ampere, where no figure exists, a clear
    error. plan --json lists each kernel's figure for the GPU."""
    from bunsan.estimator import hardware
    c, a100 = get_preset("1b"), gpu_spec("a100")
    assert hardware.FLASH_TRITON_AMPERE * 312 == pytest.approx(80)
    for seq, curves in ((16384, 1.0), (2048, 0.85 / 0.83)):     # TRITON_BY_CHUNK over FLASH_BY_CHUNK at 2k
        lay = Layout(seq_len=seq, micro_batch=1)
        fa2, port = (compute.block_time(c, lay, a100, 0.8, attention=k).attention_forward for k in ("flash", "triton"))
        assert port / fa2 == pytest.approx(hardware.FLASH_AMPERE / hardware.FLASH_TRITON_AMPERE / curves, rel=1e-6)
    args = ["plan", "--model", "1b", "--gpus", "8", "--gpu", "a100", "--seq-len", "8192", "--global-batch", "8",
            "--zero-stages", "3", "--recompute", "none", "--top", "1", "--json", "--attention", "triton"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert "Triton port's 25.6% of the peak" in out["ranked"][0]["step_seconds"]["assumptions"][0]
    assert out["pricing"]["gpu"]["attention_fractions"] == {
        "flash": hardware.FLASH_AMPERE, "cudnn": None, "triton": hardware.FLASH_TRITON_AMPERE}
    assert main(args[:6] + ["h100"] + args[7:]) != 0
    assert "attention 'triton' has no measured figure on h100" in capsys.readouterr().err
