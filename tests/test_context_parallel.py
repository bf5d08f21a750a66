"""Context parallelism against the plain single-process loop, from the same weights and data: fp32, rtol 1e-5,
SGD without clipping (a gradient-scale error shows) and one AdamW case. The tiny preset has grouped-query
attention (2 key/value heads for 4 query heads) and every case runs the causal mask; a row's tokens are cut
into 2 x cp balanced chunks, and a length that does not cut so is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity import Setup, assert_parity, compare_losses, compare_states, reference_for, reference_model, \
    sgd_no_clip, train

ROWS, SEQ = 4, 16


def layout(cp=2, dp=1, tp=1, pp=1, m=1, stage=0, steps=2, overrides=None):
    cfg = {"train_micro_batch_size_per_gpu": ROWS // (dp * m), "gradient_accumulation_steps": m,
           "context_parallel": {"size": cp}, "tensor_parallel": {"size": tp}, "pipeline": {"stages": pp},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000,
                                 "stage3_param_persistence_threshold": 0},
           "data": {"seq_len": SEQ}, "train": {"timeout_s": 60}}
    return cp * dp * tp * pp, cfg, Setup(steps=steps, rows=ROWS, seq=SEQ, overrides=overrides or {})


LAYOUTS = {
    "cp2": layout(cp=2, steps=3),
    "cp4": layout(cp=4),
    "cp2-dp2": layout(cp=2, dp=2),
    "cp2-zero3": layout(cp=2, stage=3),
    "cp2-tp2": layout(cp=2, tp=2),
    "cp2-pp2": layout(cp=2, pp=2, m=2, overrides={"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_with_unclipped_sgd_matches_single_process(pools, name):
    world, cfg, setup = LAYOUTS[name]
    cfg = sgd_no_clip(cfg)
    ref = reference_for(cfg, setup)
    doubled = reference_for(cfg, setup, grad_scale=2.0)
    assert compare_states(doubled[1], ref[1]) is not None and compare_losses(doubled[0], ref[0]) is not None
    init = {k: v.detach().numpy() for k, v in reference_model(setup).state_dict().items()}
    assert_parity(pools.run(world, train, world, cfg, setup), ref, init=init, what=name)


def test_context_parallel_with_adamw_matches_single_process(pools):
    world, cfg, setup = layout(cp=2, stage=1)
    cfg = {**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-5}},
           "gradient_clipping": 1.0}
    assert_parity(pools.run(world, train, world, cfg, setup), reference_for(cfg, setup), what="cp2 adamw")
