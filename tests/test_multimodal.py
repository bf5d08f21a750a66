"""Vision- and audio-language transformers models (tiny LLaVA: CLIP + Llama, and SigLIP + Llama; Qwen2-VL;
Qwen2.5-VL; Qwen2-Audio) trained through bunsan against the plain single-process HF loop, batches as their
processors make them (Qwen2-VL's flat patches with their grids): tensor parallelism from the plan transformers
assembles on the instance (the language model split; CLIP, SigLIP and the audio tower by bunsan's encoder plan),
ZeRO 2/3 with offload and a frozen encoder (the model states as the estimator prices them), LoRA, pipeline
stages (the encoders first), checkpoints saved at PP 2 or TP 2 resumed in one process and converted, and
gradient accumulation cutting the flat patches by image. SGD without clipping, fp32, rtol 1e-5. More layouts
(ZeRO-1, NVMe, frozen under TP/PP, PP + LoRA, TP x ZeRO on 4 ranks): tests/test_multimodal_layouts.py."""

from __future__ import annotations

import pytest
import torch

import bunsan
from parity import check_runs

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
MROPE = {"type": "mrope", "mrope_section": [2, 2, 4]}
ROWS, SEQ, STEPS, LR = 4, 24, 3, 0.5
IMAGE, START, END = 300, 301, 302


def build(kind: str):
    torch.manual_seed(0)
    if kind == "llava":
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8)
        return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(**TEXT), vision_config=vision, image_token_index=IMAGE))
    if kind == "llava_siglip":          # SigLIP's tower (no CLS token: every patch's feature, as PaliGemma's)
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=2, image_size=32, patch_size=8)
        return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(**TEXT), vision_config=vision, image_token_index=IMAGE,
            vision_feature_select_strategy="full", vision_feature_layer=-1))
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, in_chans=3)
        return transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
            text_config=dict(**TEXT, rope_scaling=MROPE), vision_config=vision, image_token_id=IMAGE,
            vision_start_token_id=START, vision_end_token_id=END))
    if kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, in_chans=3, window_size=8,
                      fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, rope_scaling=MROPE), vision_config=vision, image_token_id=IMAGE,
            vision_start_token_id=START, vision_end_token_id=END))
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                 max_source_positions=16)
    return transformers.Qwen2AudioForConditionalGeneration(transformers.Qwen2AudioConfig(
        audio_config=audio, text_config=dict(model_type="qwen2", **TEXT), audio_token_index=IMAGE))


def batches(kind: str, steps: int = STEPS) -> list[dict]:
    """As the model's processor lays them out: LLaVA one image per row (16 patch tokens); Qwen2-VL and 2.5-VL
    a different number of images per row (0 to 2, 4 tokens each: 16 flat patches merged 2x2), their patches
    flat in image order with each image's grid; Qwen2-Audio one clip per row (8 tokens)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, IMAGE, (ROWS, SEQ), generator=g)
        b = {"input_ids": ids}
        if kind in ("llava", "llava_siglip"):
            ids[:, 2:18] = IMAGE
            b["pixel_values"] = torch.randn(ROWS, 3, 32, 32, generator=g)
        elif kind == "qwen2_audio":
            ids[:, 2:10] = IMAGE
            b["input_features"] = torch.randn(ROWS, 16, 32, generator=g)
            b["feature_attention_mask"] = torch.ones(ROWS, 32, dtype=torch.long)
        else:
            images = 0
            for row, count in enumerate((1, 2, 0, 1)):
                for i in range(count):
                    at = 2 + 7 * i
                    ids[row, at], ids[row, at + 1:at + 5], ids[row, at + 5] = START, IMAGE, END
                images += count
            b["pixel_values"] = torch.randn(images * 16, 96, generator=g)
            b["image_grid_thw"] = torch.tensor([[1, 4, 4]] * images)
            b["mm_token_type_ids"] = (ids == IMAGE).long()
        b["labels"] = ids.masked_fill(ids >= IMAGE, -100)
        out.append(b)
    return out


def encoder(model):
    """The vision or audio tower (LLaVA's vision_tower, Qwen2-VL's visual, Qwen2-Audio's audio_tower)."""
    return next(getattr(model.model, name) for name in ("vision_tower", "visual", "audio_tower")
                if hasattr(model.model, name))


def built(kind: str, frozen: bool = False):
    model = build(kind)
    if frozen:
        encoder(model).requires_grad_(False)
    return model


def reference(kind: str, data: list[dict], frozen: bool = False):
    return reference_from(built(kind, frozen), data)


def reference_from(model, data: list[dict]):
    """The plain loop: SGD on the trainable parameters, the model's own loss over each whole batch."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for b in data:
        loss = model(**b).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _cfg(tp: int = 1, ga: int = 1) -> dict:
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": ga, "steps_per_print": 100,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": 0},
            "tensor_parallel": {"size": tp}}


def _train(rank, world, kind, cfg, data):
    engine = bunsan.initialize(build(kind), cfg)
    losses = [engine.train_batch(b) for b in data]
    split = sorted({type(m).__name__ for m in engine.module.modules() if hasattr(m, "tp_split")})
    towers = sorted({n.split(".")[1] for n, m in engine.module.named_modules()
                     if hasattr(m, "tp_split") and n.startswith("model.")})
    return losses, engine.consolidated_state_dict(), (split, towers)


def _train_dp(rank, world, kind, cfg, data, frozen):
    from bunsan.engine.media import split_media
    engine = bunsan.initialize(built(kind, frozen), cfg)
    losses = [engine.train_batch(split_media(b, world)[rank]) for b in data]
    memory = engine.memory_report()           # (before the consolidation gathers anything)
    return losses, engine.consolidated_state_dict(), memory


KINDS = ["llava", "llava_siglip", "qwen2_vl", "qwen2_5_vl", "qwen2_audio"]


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_from_the_plan_transformers_assembles(pools, kind):
    """The language model split by the plan transformers assembles; a CLIP or SigLIP tower, Qwen2-VL's and
    Qwen2.5-VL's vision towers (their fused qkv by sections) and Qwen2-Audio's (Whisper's) audio tower split by
    bunsan's encoder plan (tensor_parallel.encoders "split", the default)."""
    data = batches(kind)
    results = pools.run(2, _train, 2, kind, _cfg(tp=2), data)
    check_runs(results, *reference(kind, data))
    styles, towers = results[0][2]
    assert "ColumnParallelLinear" in styles and "RowParallelLinear" in styles
    split = {"llava": "vision_tower", "llava_siglip": "vision_tower", "qwen2_audio": "audio_tower",
             "qwen2_vl": "visual", "qwen2_5_vl": "visual"}
    assert towers == sorted(["language_model", split[kind]])


@pytest.mark.parametrize("kind", ["llava", "llava_siglip", "qwen2_vl"])
def test_the_vision_tower_stays_whole_when_asked(pools, kind):
    data = batches(kind)
    cfg = {**_cfg(tp=2), "tensor_parallel": {"size": 2, "encoders": "whole"}}
    results = pools.run(2, _train, 2, kind, cfg, data)
    check_runs(results, *reference(kind, data))
    assert results[0][2][1] == ["language_model"]


def test_an_encoder_tp_cannot_divide_is_refused_by_name():
    from bunsan.tensor_parallel.hf_plan import encoder_plan
    with pytest.raises(ValueError, match=r"vision_tower.*2 attention heads.*must divide.*encoders to \"whole\""):
        encoder_plan(build("llava"), 4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage,frozen,offload", [(2, False, False), (3, False, False), (3, True, False),
                                                  (3, False, True)],
                         ids=["zero2", "zero3", "zero3-frozen", "zero3-offload"])
def test_zero_on_two_ranks_each_its_rows(pools, kind, stage, frozen, offload):
    """Each data-parallel rank takes its half of the rows (Qwen2-VL's flat patches with them); ZeRO-3 with
    the encoder frozen (its weights never move, the language model's train) and with the optimizer on the
    CPU."""
    data = batches(kind)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero |= {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    cfg = {**_cfg(), "train_batch_size": ROWS, "zero_optimization": zero}
    results = pools.run(2, _train_dp, 2, kind, cfg, data, frozen)
    check_runs(results, *reference(kind, data, frozen))
    # the estimator prices the model states as the engine holds them (a frozen encoder: its weights only)
    from bunsan.estimator import estimate
    want = estimate(built(kind, frozen), cfg, gpus=2, device_type="cpu").model_states
    for _, _, memory in results:
        assert memory["model_states"] == pytest.approx(want["model_states"], rel=0.03)


@pytest.mark.parametrize("kind", KINDS)
def test_micro_batches_cut_the_processors_tensors_by_row(kind):
    """Gradient accumulation of 2 (and 4: rows without an image): every tensor cut with its rows, the flat
    patches by the images each row holds."""
    data = batches(kind)
    for ga in (2, 4):
        engine = bunsan.initialize(build(kind), _cfg(ga=ga))
        check_runs([([engine.train_batch(b) for b in data], engine.consolidated_state_dict(), None)],
               *reference(kind, data))


def test_composite_models_refuse_sequence_parallelism():
    from bunsan.comm.collectives import Comm
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
    ctx = TPContext(Comm(), Group("tp", None, 1, 0, (0,)), sequence_parallel=True)
    with pytest.raises(ValueError, match="encoders .* run whole on every rank"):
        apply_tensor_parallel(build("llava"), ctx)


def test_a_tensor_that_is_not_one_entry_per_row_and_has_no_grouping_is_refused_by_name():
    engine = bunsan.initialize(build("llava"), _cfg(ga=2))
    b = batches("llava", 1)[0]
    b["pixel_values"] = torch.randn(3, 3, 32, 32)          # 3 images for 4 rows of one image each
    with pytest.raises(ValueError, match="pixel_values"):
        engine.train_batch(b)


LORA = {"enabled": True, "r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _train_lora(rank, world, kind, cfg, data):
    from bunsan.engine.media import split_media
    engine = bunsan.initialize(build(kind), cfg)
    dp, dp_rank = engine.mesh.dp, engine.mesh.dp_rank
    losses = [engine.train_batch(split_media(b, dp)[dp_rank]) for b in data]
    return losses, engine.consolidated_state_dict(), None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", [dict(tp=2), dict(stage=3)], ids=["tp2", "dp2-zero3"])
def test_lora_on_a_multimodal_model_matches_the_plain_loop_over_the_same_adapters(pools, kind, layout):
    """Adapters on the language model's q/v/down projections and on the tower's layers of those names (CLIP's,
    SigLIP's and the audio tower's q/v; Qwen2.5-VL's gated MLP's down; Qwen2-VL's none: its q, k and v are one
    fused qkv), base frozen; under TP 2 a split tower's adapters are split with their layers. (PP 2:
    tests/test_multimodal_layouts.py.)"""
    from bunsan.config.root import Config
    from bunsan.transforms.lora import apply_lora
    data = batches(kind)
    cfg = {**_cfg(tp=layout.get("tp", 1)), "lora": LORA, "train": {"seed": 0},
           "zero_optimization": {"stage": layout.get("stage", 0), "stage3_param_persistence_threshold": 0}}
    results = pools.run(2, _train_lora, 2, kind, cfg, data)
    model = build(kind)
    apply_lora(model, Config.load({"lora": LORA}).lora, seed=0)
    ref_losses, state = reference_from(model, data)
    towers = ("model.vision_tower.", "model.visual.", "model.audio_tower.")
    adapted = {k.split(".lora_A.")[0].rpartition(".")[2] for k in state if ".lora_A." in k and k.startswith(towers)}
    assert adapted == {"qwen2_vl": set(), "qwen2_5_vl": {"down_proj"}}.get(kind, {"q_proj", "v_proj"})
    check_runs(results, ref_losses, state)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_lora_on_the_fused_qkv_of_a_split_vision_tower_matches_the_plain_loop(pools, kind):
    """Adapters on the vision blocks' fused qkv under TP 2: the base and B split by sections with it (each rank
    its heads' rows of q, k and v), A whole with its gradient summed over the ranks: the plain loop over the
    same adapters."""
    from bunsan.config.root import Config
    from bunsan.transforms.lora import apply_lora
    data = batches(kind)
    lora = {**LORA, "target_modules": ["qkv"]}
    cfg = {**_cfg(tp=2), "lora": lora, "train": {"seed": 0}}
    results = pools.run(2, _train_lora, 2, kind, cfg, data)
    model = build(kind)
    apply_lora(model, Config.load({"lora": lora}).lora, seed=0)
    ref_losses, state = reference_from(model, data)
    assert {k for k in state if ".lora_B." in k} == {f"model.visual.blocks.{i}.attn.qkv.lora_B.default.weight"
                                                     for i in range(2)}
    check_runs(results, ref_losses, state)


def _train_pp(rank, world, kind, cfg, data):
    engine = bunsan.initialize(build(kind), cfg)
    losses = [engine.train_batch(b) for b in data]
    return losses, engine.consolidated_state_dict(), sorted(n for n, _ in engine.module.named_parameters())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", [dict(schedule="1f1b"), dict(schedule="gpipe", tp=2)], ids=["pp2", "pp2-tp2"])
def test_pipeline_stages_the_encoders_first(pools, kind, layout):
    """PP 2 over 2 micro-batches: the encoder, projector and embedding on the first stage with the first
    decoder layer; every stage gets the batch's keys (the later one recomputes Qwen2-VL's 3D positions)."""
    data = batches(kind)
    tp = layout.get("tp", 1)
    cfg = {**_cfg(tp=tp, ga=2), "pipeline": {"stages": 2, "schedule": layout["schedule"]}}
    results = pools.run(2 * tp, _train_pp, 2 * tp, kind, cfg, data)
    check_runs(results, *reference(kind, data))
    first, last = results[0][2], results[-1][2]
    tower = next(f"model.{n.split('.')[1]}." for n in first
                 if n.startswith(("model.vision_tower.", "model.visual.", "model.audio_tower.")))
    assert not any(n.startswith(tower) for n in last)
    assert "lm_head.weight" in last and not any(".layers.1." in n and "language_model" in n for n in first)


def _train_and_save(rank, world, kind, cfg, data, folder):
    engine = bunsan.initialize(build(kind), cfg)
    losses = [engine.train_batch(b) for b in data]
    engine.save_checkpoint(folder)
    return losses


def _resume_and_train(rank, world, kind, cfg, data, folder):
    engine = bunsan.initialize(build(kind), cfg)
    engine.load_checkpoint(folder)
    return [engine.train_batch(b) for b in data], engine.consolidated_state_dict(), None


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_a_checkpoint_saved_in_one_process_resumes_with_the_fused_qkv_split(pools, kind, tmp_path):
    """Two steps in one process, the third at TP 2 from its checkpoint: each rank reads its heads' rows of q, k
    and v out of the whole qkv weight and bias (their sections placed apart): the loop's three steps."""
    data = batches(kind)
    engine = bunsan.initialize(build(kind), _cfg(ga=2))
    first = [engine.train_batch(b) for b in data[:2]]
    engine.save_checkpoint(str(tmp_path))
    results = pools.run(2, _resume_and_train, 2, kind, _cfg(tp=2, ga=2), data[2:], str(tmp_path))
    check_runs([(first + losses, state, None) for losses, state, _ in results], *reference(kind, data))


@pytest.mark.parametrize("kind,layout", [(k, "pp2") for k in KINDS] +
                         [(k, "tp2") for k in ("llava_siglip", "qwen2_vl", "qwen2_5_vl", "qwen2_audio")])
def test_a_checkpoint_saved_across_ranks_resumes_in_one_process(pools, kind, layout, tmp_path):
    """Two steps at PP 2 (saved by each stage) or TP 2 (each rank its shards, the towers split where bunsan
    splits them), the third in one process from the checkpoint (the layout resharded, the optimizer's state
    with it): the loop's three steps. `bunsan convert --to hf` of the checkpoint is a directory transformers
    loads as the model (the class its config.json names), with the saved weights."""
    import json
    data = batches(kind)
    cfg = {**_cfg(tp=1, ga=2), "pipeline": {"stages": 2}} if layout == "pp2" else _cfg(tp=2, ga=2)
    first = pools.run(2, _train_and_save, 2, kind, cfg, data[:2], str(tmp_path))
    engine = bunsan.initialize(build(kind), _cfg(ga=2))
    engine.load_checkpoint(str(tmp_path))
    saved = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    done = pools.cli(1, ["convert", tmp_path, tmp_path / "hf", "--to", "hf"])[0]
    assert done.returncode == 0, done.stdout + done.stderr
    named = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"]
    assert named == [type(build(kind)).__name__]
    converted = getattr(transformers, named[0]).from_pretrained(tmp_path / "hf")
    assert converted.state_dict().keys() == saved.keys()
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in saved.items())
    losses = first[-1] + [engine.train_batch(data[2])]
    check_runs([(losses, engine.consolidated_state_dict(), None)], *reference(kind, data))
