"""More layouts of the vision- and audio-language models of tests/test_multimodal.py against the same plain loop
(SGD without clipping, fp32, rtol 1e-5): ZeRO-1, ZeRO-2 with the optimizer on the CPU, ZeRO-3 on NVMe, a frozen
encoder under TP 2 and under PP 2, LoRA through pipeline stages, and TP 2 x ZeRO over data-parallel 2 (4 ranks).
Each spawned run trains several layouts one after another (one pool dispatch, one comparison each)."""

from __future__ import annotations

import pytest
import torch

import bunsan
from test_multimodal import KINDS, LORA, _cfg, batches, build, built, check_runs, reference, reference_from

transformers = pytest.importorskip("transformers")


def _layouts(rank, world, kind, layouts, data):
    """Each (cfg, frozen) of `layouts` in turn: this rank's rows of every batch (its data-parallel share, Qwen2-VL's
    flat patches with them), the losses, the consolidated weights, the names of the parameters it trained."""
    from bunsan.engine.media import split_media
    out = []
    for cfg, frozen in layouts:
        engine = bunsan.initialize(built(kind, frozen), cfg)
        dp, dp_rank = engine.mesh.dp, engine.mesh.dp_rank
        losses = [engine.train_batch(split_media(b, dp)[dp_rank]) for b in data]
        trained = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
        out.append((losses, engine.consolidated_state_dict(), trained))
    return out


def _check(results, refs, names):
    """results: per rank, one result per layout; refs: (losses, state) per layout."""
    for i, (ref, name) in enumerate(zip(refs, names)):
        try:
            check_runs([r[i] for r in results], *ref)
        except AssertionError as e:
            raise AssertionError(f"layout {name}: {e}") from None


def _zero(stage: int, **more) -> dict:
    return {**_cfg(), "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **more}}


@pytest.mark.parametrize("kind", KINDS)
def test_zero1_zero2_offloaded_and_zero3_on_nvme(pools, kind, tmp_path):
    """Two data-parallel ranks, each its rows: ZeRO-1; ZeRO-2 with the optimizer stepping on the CPU; ZeRO-3 with
    parameters and optimizer states on NVMe (one sub-group at a time)."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    layouts = {"zero1": (_zero(1), False),
               "zero2-offload": (_zero(2, offload_optimizer={"device": "cpu"}), False),
               "zero3-nvme": (_zero(3, offload_optimizer=nvme, offload_param=nvme, sub_group_size=20_000), False)}
    data = batches(kind)
    results = pools.run(2, _layouts, 2, kind, list(layouts.values()), data)
    ref = reference(kind, data)
    _check(results, [ref] * len(layouts), list(layouts))


@pytest.mark.parametrize("kind", KINDS)
def test_a_frozen_encoder_under_tensor_and_pipeline_parallelism(pools, kind):
    """The encoder frozen (requires_grad_(False)), TP 2 (its tower split where bunsan splits it) and PP 2 (its
    tower on the first stage): the language model trains as in the loop, the encoder does not move."""
    layouts = {"tp2-frozen": (_cfg(tp=2), True),
               "pp2-frozen": ({**_cfg(ga=2), "pipeline": {"stages": 2}}, True)}
    data = batches(kind)
    results = pools.run(2, _layouts, 2, kind, list(layouts.values()), data)
    _check(results, [reference(kind, data, frozen=True)] * len(layouts), list(layouts))
    start = build(kind).state_dict()
    for rank in results:
        for _, state, trained in rank:
            tower = [k for k in start if k.startswith(("model.vision_tower.", "model.visual.", "model.audio_tower."))]
            assert tower and all(torch.equal(state[k], start[k]) for k in tower)
            assert not any(n.startswith(("model.vision_tower.", "model.visual.", "model.audio_tower."))
                           for n in trained)


def _lora_reference(kind, data):
    from bunsan.config.root import Config
    from bunsan.transforms.lora import apply_lora
    model = build(kind)
    apply_lora(model, Config.load({"lora": LORA}).lora, seed=0)
    return reference_from(model, data)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_through_pipeline_stages(pools, kind):
    """PP 2 with LoRA's adapters (the tower's with the first stage's): the loop's steps over the same adapters."""
    cfg = {**_cfg(ga=2), "pipeline": {"stages": 2}, "lora": LORA, "train": {"seed": 0}}
    data = batches(kind)
    results = pools.run(2, _layouts, 2, kind, [(cfg, False)], data)
    _check(results, [_lora_reference(kind, data)], ["pp2-lora"])
    assert all(".lora_" in n for rank in results for n in rank[0][2])


@pytest.mark.parametrize("kind", ["llava_siglip", "qwen2_vl", "qwen2_audio"])
def test_tensor_parallel_by_zero_over_two_data_parallel_ranks(pools, kind):
    """4 ranks: TP 2 (the towers split where bunsan splits them) x data-parallel 2 with ZeRO-1 and ZeRO-3."""
    layouts = {f"tp2-dp2-zero{stage}": ({**_zero(stage), "tensor_parallel": {"size": 2}}, False) for stage in (1, 3)}
    data = batches(kind)
    results = pools.run(4, _layouts, 4, kind, list(layouts.values()), data)
    _check(results, [reference(kind, data)] * len(layouts), list(layouts))
