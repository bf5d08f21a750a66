"""Every parallel layout with plain SGD and no clipping against the plain single-process loop: losses and final
weights, fp32, rtol 1e-5.

Clipping to 1 turns the update into g/|g|, and Adam divides each element by its own magnitude: a uniform
gradient-scale error (gradients 2x too big, from a mean over the wrong count of ranks, micro-batches, stages or
tensor-parallel slices) cancels under both. SGD's update is linear in the gradient, so here it shows; each case
also checks that its plain loop run with gradients 2x too big would fail the comparison, so the tolerance
resolves such an error for that layout's steps and data. The clipped and AdamW variants of these layouts, and
what is particular to each (traffic, memory, checkpoints), are in the layout's own test file.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity import Setup, assert_parity, compare_losses, compare_states, reference_for, reference_model, \
    sgd_no_clip, train

STEPS, ROWS, SEQ = 3, 8, 16
SETUP = Setup(steps=STEPS, rows=ROWS, seq=SEQ)
LORA = {"enabled": True, "r": 4, "alpha": 8.0, "dropout": 0.0,
        "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]}
KV4 = {"num_key_value_heads": 4}          # tiny has 2 key/value heads: 4 for TP=4
TIED = {"tie_word_embeddings": True}      # the embedding and head on different stages: their gradients summed
WIDE_HEADS = {"head_dim": 48}             # heads 48 wide, not hidden / heads = 32 (Mistral Nemo's form)


def layout(dp=1, tp=1, sp=False, pp=1, schedule="1f1b", m=1, v=1, stage=0, offload_optimizer=None,
           offload_param=None, lora=False, overrides=None, build="plain", ignore_frac=0.0, gather=None):
    """(world, config without optimizer or clipping, Setup) of one layout; `m` micro-batches per step."""
    zero = {"stage": stage, "reduce_bucket_size": 50_000, "stage3_param_persistence_threshold": 0}
    if gather:
        zero["stage3_pipeline_gather"] = gather
    if offload_optimizer:
        zero.update(offload_optimizer={"device": offload_optimizer}, sub_group_size=40_000)
    if offload_param:
        zero["offload_param"] = {"device": offload_param}
    cfg = {"train_micro_batch_size_per_gpu": ROWS // (dp * m), "gradient_accumulation_steps": m,
           "tensor_parallel": {"size": tp, "sequence_parallel": sp},
           "pipeline": {"stages": pp, "schedule": schedule, "virtual_stages": v},
           "zero_optimization": zero, "train": {"timeout_s": 60}}
    if lora:
        cfg["lora"] = LORA
    return dp * tp * pp, cfg, SETUP.replace(overrides=overrides or {}, build=build, ignore_frac=ignore_frac)


LAYOUTS = {
    # data parallel (ZeRO stage 0); labels -100 in different numbers per rank: the global token mean
    "dp2": layout(dp=2),
    "dp4-accum2": layout(dp=4, m=2),
    "dp2-accum2-ignored-labels": layout(dp=2, m=2, ignore_frac=0.3),
    # ZeRO 1-3
    **{f"zero{s}-dp2": layout(dp=2, stage=s) for s in (1, 2, 3)},
    **{f"zero{s}-dp4-accum2": layout(dp=4, m=2, stage=s) for s in (1, 2, 3)},
    # offload: the optimizer's shard (master, states, the fp32 gradient) in host memory or on disk, ZeRO-3's
    # parameter shards too
    **{f"zero{s}-offload-optimizer-cpu": layout(dp=2, stage=s, offload_optimizer="cpu") for s in (1, 2, 3)},
    "zero3-offload-param-cpu-accum2": layout(dp=2, m=2, stage=3, offload_param="cpu"),
    "zero3-offload-optimizer-param-cpu-accum2": layout(dp=2, m=2, stage=3, offload_optimizer="cpu",
                                                       offload_param="cpu"),
    "zero2-offload-optimizer-nvme": layout(dp=2, stage=2, offload_optimizer="nvme"),
    "zero3-offload-optimizer-param-nvme-accum2": layout(dp=2, m=2, stage=3, offload_optimizer="nvme",
                                                        offload_param="nvme"),
    # tensor parallel, with and without sequence parallelism, alone and with DP x ZeRO
    "tp2": layout(tp=2),
    "tp2-sp": layout(tp=2, sp=True),
    "tp4": layout(tp=4, overrides=KV4),
    "tp4-sp": layout(tp=4, sp=True, overrides=KV4),
    "tp2-dp2-zero1": layout(tp=2, dp=2, stage=1),
    "tp2-sp-head-dim-apart": layout(tp=2, sp=True, overrides=WIDE_HEADS),
    "tp2-sp-dp2-zero1": layout(tp=2, sp=True, dp=2, stage=1),
    "tp2-dp2-zero3": layout(tp=2, dp=2, stage=3),
    "tp2-sp-dp2-zero3": layout(tp=2, sp=True, dp=2, stage=3),
    # pipeline parallel, every schedule
    "pp2-gpipe": layout(pp=2, schedule="gpipe", m=2),
    "pp2-1f1b": layout(pp=2, schedule="1f1b", m=4),
    "pp2-interleaved": layout(pp=2, schedule="interleaved", m=4, v=2),
    "pp4-gpipe": layout(pp=4, schedule="gpipe", m=4),
    "pp4-1f1b": layout(pp=4, schedule="1f1b", m=8),
    "pp4-interleaved": layout(pp=4, schedule="interleaved", m=4, v=2, overrides={"num_hidden_layers": 8}),
    # pipeline x data parallel, pipeline x tensor parallel, all three
    "pp2-gpipe-dp2": layout(pp=2, schedule="gpipe", m=2, dp=2, overrides=TIED),
    "pp2-dp2": layout(pp=2, m=2, dp=2, overrides=TIED),
    "pp2-dp2-zero1": layout(pp=2, m=2, dp=2, stage=1, overrides=TIED),
    "pp2-interleaved-dp2": layout(pp=2, schedule="interleaved", m=4, v=2, dp=2, overrides=TIED),
    "pp2-tp2": layout(pp=2, m=2, tp=2, overrides=TIED),
    "pp2-tp2-sp": layout(pp=2, m=2, tp=2, sp=True, overrides=TIED),
    "pp2-dp2-tp2-zero1": layout(pp=2, m=2, dp=2, tp=2, stage=1, overrides=TIED),
    # pipeline x ZeRO-2/3: gradients reduced once after the schedule; ZeRO-3's blocks gathered per micro-batch
    # or once per schedule
    "pp2-zero3": layout(pp=2, m=2, stage=3),
    "pp2-dp2-zero2": layout(pp=2, m=2, dp=2, stage=2, overrides=TIED),
    "pp2-dp2-zero3": layout(pp=2, m=2, dp=2, stage=3, overrides=TIED),
    "pp2-dp2-zero3-schedule": layout(pp=2, m=2, dp=2, stage=3, gather="schedule", overrides=TIED),
    "pp2-interleaved-dp2-zero3": layout(pp=2, schedule="interleaved", m=4, v=2, dp=2, stage=3, overrides=TIED),
    "pp2-dp2-tp2-sp-zero3": layout(pp=2, m=2, dp=2, tp=2, sp=True, stage=3, overrides=TIED),
    # LoRA (frozen base, trained adapters) on each
    "lora-dp2": layout(dp=2, lora=True),
    "lora-dp2-zero3": layout(dp=2, stage=3, lora=True),
    "lora-tp2": layout(tp=2, lora=True),
    "lora-tp2-sp": layout(tp=2, sp=True, lora=True),
    "lora-pp2": layout(pp=2, m=2, lora=True, build="meta"),
    "lora-tp2-dp2-zero1": layout(tp=2, dp=2, stage=1, lora=True),
    "lora-tp2-dp2-zero3": layout(tp=2, dp=2, stage=3, lora=True),
}


def _with_paths(cfg: dict, path: str) -> dict:
    """The swap files of an NVMe offload under this test's temporary folder."""
    zero = dict(cfg["zero_optimization"])
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key, {}).get("device") == "nvme":
            zero[key] = {**zero[key], "nvme_path": path}
    return {**cfg, "zero_optimization": zero}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_with_unclipped_sgd_matches_single_process(pools, tmp_path, name, momentum):
    world, cfg, setup = LAYOUTS[name]
    cfg = _with_paths(sgd_no_clip(cfg, momentum=momentum), str(tmp_path))
    ref = reference_for(cfg, setup)
    # The comparison resolves a uniform gradient-scale error: the plain loop with gradients 2x is told apart.
    doubled = reference_for(cfg, setup, grad_scale=2.0)
    assert compare_states(doubled[1], ref[1]) is not None and compare_losses(doubled[0], ref[0]) is not None
    init = {k: v.detach().numpy() for k, v in reference_model(setup, cfg.get("lora")).state_dict().items()}
    assert any(not np.array_equal(init[k], v.numpy()) for k, v in ref[1].items())
    assert_parity(pools.run(world, train, world, cfg, setup), ref, init=init, what=name)
