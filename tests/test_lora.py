"""LoRA: only the adapters train (gradients and optimizer states for them alone), and merging them gives the
same model."""

import pytest
import torch

from parity import batches, rank_slice, tiny_model

pytest.importorskip("peft")

LORA = {"enabled": True, "r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _train(rank, world, zero, ckpt=None):
    import bunsan
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0}, "lora": LORA,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "train": {"timeout_s": 60}}
    engine = bunsan.initialize(tiny_model(0), cfg)
    before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    for data in batches(4, 8):
        engine.train_batch(rank_slice(data, engine.dp_rank, engine.dp_size))
    after = engine.consolidated_state_dict()
    if ckpt:
        engine.save_checkpoint(ckpt)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return before, after, engine.memory_report(), trainable


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_only_adapters_train(pools, zero):
    total = sum(p.numel() for p in tiny_model(0).parameters())
    for before, after, mem, trainable in pools.run(2, _train, 2, zero):
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and all(".lora_" in k for k in changed)          # every base weight untouched
        assert any(".lora_B." in k for k in changed)                     # B starts at zero and moves
        # AdamW: two fp32 moments per trainable element, sharded over 2 ranks at stage 2; nothing for the base
        want = 8 * trainable / (2 if zero else 1)
        assert mem["optimizer_states"] == pytest.approx(want, rel=0.01)
        assert mem["grads"] <= 4 * trainable * 1.01
        if zero == 3:   # the frozen base is sharded too: each of the 2 ranks keeps half of every weight at rest
            assert mem["params"] <= 4 * (total + trainable) / 2 * 1.02
            assert mem["grads"] <= 4 * trainable / 2 * 1.05
        from bunsan.estimator import estimate     # the estimate knows: frozen base, trainable adapters
        est = estimate(tiny_model(0), {"zero_optimization": {"stage": zero, "stage3_param_persistence_threshold": 0}, "lora": LORA,
                                       "train_batch_size": 8}, gpus=2, device_type="cpu")
        assert est.model_states["model_states"] == pytest.approx(mem["model_states"], rel=0.05)


def test_merged_adapters_give_the_same_logits():
    import peft
    from bunsan.transforms.lora import apply_lora, merge_lora
    from bunsan.config.root import Config
    model = tiny_model(0)
    apply_lora(model, Config.load({"lora": LORA}).lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)                                       # a trained adapter
    model.eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want = model(ids)
        plain = tiny_model(1)
        plain.load_state_dict(merge_lora(model.state_dict(), LORA["alpha"], LORA["r"]), strict=False)
        torch.testing.assert_close(plain.eval()(ids), want, rtol=1e-5, atol=1e-5)
    assert peft.__version__


def test_convert_merges_a_lora_checkpoint(pools, tmp_path):
    from safetensors.torch import load_file
    from bunsan.cli.main import main
    _, after, _, _ = pools.run(2, _train, 2, 1, str(tmp_path / "ck"))[0]
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "m.safetensors"), "--merge-lora"]) == 0
    merged = load_file(str(tmp_path / "m.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in merged)
    assert "layers.0.self_attn.q_proj.weight" in merged and "layers.0.self_attn.k_proj.weight" in merged
