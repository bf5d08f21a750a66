"""Encoder towers under tensor parallelism (tensor_parallel.encoders "split", bunsan's ENCODER_PLANS): Whisper's
encoder layer (Qwen2-Audio's is its copy; Qwen2-Audio's parity at TP 2 with its tower split is in
tests/test_multimodal.py) split by heads and MLP width gives the whole encoder's output and gradients, as do
Qwen2-VL's and Qwen2.5-VL's vision blocks with their fused qkv split by sections; a tower bunsan has no split for
is said to stay whole, never silently."""

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


def _split_qwen_tower(rank, world, kind):
    """Qwen2-VL's (or Qwen2.5-VL's) vision tower whole, then split by its encoder plan (the fused qkv by
    sections), on the same flat patches of two images of different grids."""
    import torch.distributed as dist

    from bunsan.comm.collectives import Comm
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
    from bunsan.tensor_parallel.hf_plan import encoder_plan
    from test_multimodal import build, encoder
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    patches = torch.randn(16 + 32, 96, generator=torch.Generator().manual_seed(1))

    def run(tower):
        x = patches.clone().requires_grad_(True)
        out = tower(x, grid_thw=grid)
        out = getattr(out, "pooler_output", None) if not isinstance(out, torch.Tensor) else out
        out.square().mean().backward()
        return out.detach(), x.grad, {n: p.grad for n, p in tower.named_parameters()}
    whole = run(encoder(build(kind)))
    tower = encoder(build(kind))
    ctx = TPContext(Comm(), Group("tp", dist.group.WORLD, world, rank, tuple(range(world))))
    apply_tensor_parallel(tower, ctx, encoder_plan(tower, world))
    split = run(tower)
    heads = {n: m.num_heads for n, m in tower.named_modules() if n.endswith(".attn")}
    shards = {f"{n}.{p}": (dim, getattr(m, "tp_sections", 1)) for n, m in tower.named_modules()
              for p, (_, dim) in getattr(m, "tp_split", {}).items()}
    return whole, split, heads, shards


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vision_blocks_split_by_heads_give_the_whole_towers_output_and_gradients(pools, kind):
    """Each rank its heads' rows of q, k and v out of the fused qkv (and its share of the MLP): the tower's
    output and the patches' gradient are the whole tower's, every weight's gradient its shard of the whole
    one's (qkv's: the rank's rows of each of q, k and v)."""
    from bunsan.tensor_parallel.layers import split_sections
    for rank, (whole, split, heads, shards) in enumerate(pools.run(2, _split_qwen_tower, 2, kind)):
        torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-6)
        assert heads == {f"blocks.{i}.attn": 1 for i in range(2)}                   # each rank its 1 of 2
        assert shards["blocks.0.attn.qkv.weight"] == (0, 3) and shards["blocks.1.attn.qkv.bias"] == (0, 3)
        mlp = {"mlp.fc1", "mlp.fc2"} if kind == "qwen2_vl" else {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
        assert {k.split(".", 2)[2].rpartition(".")[0] for k in shards} == {"attn.qkv", "attn.proj"} | mlp
        for name, grad in split[2].items():
            want = whole[2][name]
            if name in shards:
                dim, sections = shards[name]
                want = split_sections(want, 2, rank, sections) if sections > 1 else want.chunk(2, dim)[rank]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_tower_bunsan_has_no_split_for_is_said_to_stay_whole(monkeypatch):
    """"split" (the default) on a tower whose block bunsan has no plan for: the tower runs whole on every rank,
    and a warning names it; "whole" says so itself, without a warning."""
    from bunsan.tensor_parallel import hf_plan
    from test_multimodal import build
    monkeypatch.delitem(hf_plan.ENCODER_PLANS, "Qwen2VLVisionBlock")
    model = build("qwen2_vl")
    assert hf_plan.whole_towers(model) == {"model.visual": ["Qwen2VLVisionBlock"]}
    with pytest.warns(UserWarning, match=r"tensor_parallel.encoders is \"split\", but model.visual "
                                         r"\(Qwen2VLVisionBlock\) has no split bunsan implements .* kept whole, "
                                         r"computed in full on every tensor-parallel rank; set "
                                         r"tensor_parallel.encoders to \"whole\""):
        plan = hf_plan.hf_tp_plan(model, False, "split", 2)
    assert not any(p.startswith("model.visual") for p in plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_plan.hf_tp_plan(model, False, "whole", 2)


@pytest.mark.parametrize("kind", ["llava", "llava_siglip", "qwen2_audio", "qwen2_vl", "qwen2_5_vl"])
def test_the_towers_bunsan_splits_are_not_said_to_stay_whole(kind):
    from bunsan.tensor_parallel.hf_plan import hf_tp_plan, whole_towers
    from test_multimodal import build
    model = build(kind)
    assert whole_towers(model) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = hf_tp_plan(model, False, "split", 2)
    tower = {"qwen2_audio": "model.audio_tower", "qwen2_vl": "model.visual", "qwen2_5_vl": "model.visual"}.get(
        kind, "model.vision_tower")
    columns = {"qwen2_vl": 1, "qwen2_5_vl": 2}.get(kind, 4)      # per layer: fc1 (gate, up); q, k, v and fc1
    assert sum(p.startswith(tower) and s == "column" for p, s in plan.items()) == 2 * columns
    if kind.startswith("qwen2_") and kind != "qwen2_audio":
        assert plan[f"{tower}.blocks.0.attn.qkv"] == "column_qkv"
        assert plan[f"{tower}.blocks.0.attn"] == "parallel_attention"
    if kind == "qwen2_audio":      # fc1's input enters the parallel region at the norm, not at the layer
        assert plan[f"{tower}.layers.0.final_layer_norm"] == "parallel_output"
        assert plan[f"{tower}.layers.0.self_attn"] == "parallel_attention" and f"{tower}.layers.0" not in plan
