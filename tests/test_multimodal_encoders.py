"""Encoder towers under tensor parallelism (tensor_parallel.encoders "split", bunsan's ENCODER_PLANS): Whisper's
encoder layer (Qwen2-Audio's is its copy; Qwen2-Audio's parity at TP 2 with its tower split is in
tests/test_multimodal.py) split by heads and MLP width gives the whole encoder's output and gradients, and a tower
bunsan has no split for (Qwen2-VL's and Qwen2.5-VL's fused qkv) is said to stay whole, never silently."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

WHISPER = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=16,
               max_source_positions=16, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1)


def whisper_encoder():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(**WHISPER)
    config._attn_implementation = "sdpa"
    return transformers.models.whisper.modeling_whisper.WhisperEncoder(config)


def _split_encoder(rank, world):
    """The whole encoder's forward and backward, then the split one's, on the same features."""
    import torch.distributed as dist

    from bunsan.comm.collectives import Comm
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
    from bunsan.tensor_parallel.hf_plan import encoder_plan
    features = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))

    def run(model):
        x = features.clone().requires_grad_(True)
        out = model(x).last_hidden_state
        out.square().mean().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}
    whole = run(whisper_encoder())
    model = whisper_encoder()
    ctx = TPContext(Comm(), Group("tp", dist.group.WORLD, world, rank, tuple(range(world))))
    apply_tensor_parallel(model, ctx, encoder_plan(model, world))
    split = run(model)
    heads = {n: m.num_heads for n, m in model.named_modules() if n.endswith("self_attn")}
    shards = {f"{n}.{p}": dim for n, m in model.named_modules() for p, (_, dim) in getattr(m, "tp_split", {}).items()}
    return whole, split, heads, shards


def test_whisper_encoder_layers_split_by_heads_give_the_whole_encoders_output_and_gradients(pools):
    for rank, (whole, split, heads, shards) in enumerate(pools.run(2, _split_encoder, 2)):
        torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-6)          # the output
        torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-6)          # the features' gradient
        assert heads == {f"layers.{i}.self_attn": 2 for i in range(2)}               # each rank its 2 of 4
        assert {k.split(".", 2)[2].rpartition(".")[0] for k in shards} == {
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2"}
        for name, grad in split[2].items():     # every weight's gradient: its shard of the whole one's
            want = whole[2][name]
            if name in shards:
                want = want.chunk(2, shards[name])[rank]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_whisper_layers_heads_must_divide():
    from bunsan.tensor_parallel.hf_plan import encoder_plan
    with pytest.raises(ValueError, match=r"layers\.0 \(WhisperEncoderLayer\) has 4 attention heads.*must divide"):
        encoder_plan(whisper_encoder(), 8)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_a_tower_bunsan_cannot_split_is_said_to_stay_whole(kind):
    """"split" (the default) on Qwen2-VL's or Qwen2.5-VL's vision tower: its blocks' q, k and v are one fused
    linear, which bunsan does not split; the tower runs whole on every rank, and a warning names it; "whole"
    says so itself, without a warning."""
    from bunsan.tensor_parallel.hf_plan import hf_tp_plan, whole_towers
    from test_multimodal import build
    model = build(kind)
    block = "Qwen2VLVisionBlock" if kind == "qwen2_vl" else "Qwen2_5_VLVisionBlock"
    assert whole_towers(model) == {"model.visual": [block]}
    with pytest.warns(UserWarning, match=rf"tensor_parallel.encoders is \"split\", but model.visual \({block}\) has "
                                         r"no split bunsan implements .* kept whole, computed in full on every "
                                         r"tensor-parallel rank; set tensor_parallel.encoders to \"whole\""):
        plan = hf_tp_plan(model, False, "split", 2)
    assert not any(p.startswith("model.visual") for p in plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_tp_plan(model, False, "whole", 2)


@pytest.mark.parametrize("kind", ["llava", "llava_siglip", "qwen2_audio"])
def test_the_towers_bunsan_splits_are_not_said_to_stay_whole(kind):
    from bunsan.tensor_parallel.hf_plan import hf_tp_plan, whole_towers
    from test_multimodal import build
    model = build(kind)
    assert whole_towers(model) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = hf_tp_plan(model, False, "split", 2)
    tower = "model.audio_tower" if kind == "qwen2_audio" else "model.vision_tower"
    assert sum(p.startswith(tower) and s == "column" for p, s in plan.items()) == 2 * 4    # 2 layers: q, k, v, fc1
    if kind == "qwen2_audio":      # fc1's input enters the parallel region at the norm, not at the layer
        assert plan[f"{tower}.layers.0.final_layer_norm"] == "parallel_output"
        assert plan[f"{tower}.layers.0.self_attn"] == "parallel_attention" and f"{tower}.layers.0" not in plan
