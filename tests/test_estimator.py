"""The estimator's formulas against what torch really saves and holds, and its examples."""

import json
from dataclasses import replace

import pytest
import torch
from bunsan.models.loss import lm_loss_sum

from bunsan.estimator import estimate, estimate_layout, load_shape, rank_params, zero_paper
from bunsan.estimator.activations import Micro, block_bytes, block_input_bytes, loss_bytes, stage_activation_bytes
from bunsan.memory.theory import model_state_bytes
from bunsan.models import Llama
from bunsan.models.presets import build_config
from bunsan.estimator.layout import Layout
from bunsan.transforms.checkpointing import apply_activation_checkpointing

GB = 1e9


def test_zero_paper_example():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B, N = 64, K = 12.
    got = [round(zero_paper(7.5e9, 64, 12, s) / GB, 1) for s in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def _saved_bytes(model, ids, loss: bool) -> float:
    """Bytes of the distinct storages autograd saves in forward, parameters and buffers excluded."""
    skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        if loss:
            lm_loss_sum(logits, ids)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_formula_matches_saved_tensors(dtype, kv_heads, checkpointing):
    cfg = build_config("tiny", num_hidden_layers=3, vocab_size=512, num_key_value_heads=kv_heads)
    model = Llama(cfg).to(dtype)
    if checkpointing:
        apply_activation_checkpointing(model)
    b, s = 3, 40
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    m = Micro(b, s, dtype.itemsize, device="cpu")   # CPU SDPA takes K/V with their own heads (enable_gqa)
    per_block = block_input_bytes(cfg, m) if checkpointing else block_bytes(cfg, m)
    if dtype == torch.float32:   # on CUDA fp32 K/V are repeated to every query head, and priced so
        repeated = 2 * 4 * b * s * (cfg.num_attention_heads - kv_heads) * cfg.head_dim
        assert block_bytes(cfg, replace(m, device="cuda")) - block_bytes(cfg, m) == repeated
    one = build_config("tiny", num_hidden_layers=1, vocab_size=512, num_key_value_heads=kv_heads)
    one_model = Llama(one).to(dtype)
    if checkpointing:
        apply_activation_checkpointing(one_model)
    # Two depths isolate one block exactly; the whole stage (embedding, head, loss) is checked too.
    assert _saved_bytes(model, ids, False) - _saved_bytes(one_model, ids, False) == pytest.approx(2 * per_block)
    est = stage_activation_bytes(cfg, m, 3, first=True, last=True, checkpointing=checkpointing)
    assert _saved_bytes(model, ids, True) == pytest.approx(est["kept"])
    assert loss_bytes(cfg, m)[0] == dtype.itemsize * b * s * cfg.vocab_size     # the logits, saved by lm_loss


def test_model_states_follow_the_zero_formulas():
    shape = load_shape("tiny")
    psi = shape.n_params
    for stage in range(4):
        for d in (4, 2):
            lay = Layout(dp=4, zero=stage, precision="fp32" if d == 4 else "bf16", seq_len=64)
            got = estimate_layout(shape, lay).model_states
            want = model_state_bytes(psi, d, 8.0, 4, stage, grad_shard_bytes=4)
            # Only the per-bucket padding (< 4 x 16 elements a bucket) separates them.
            assert got["model_states"] == pytest.approx(want["total"], rel=1e-3)


def test_rank_params_cut_like_training():
    shape = load_shape(build_config("tiny", tie_word_embeddings=True))
    total = shape.n_params
    ranks = rank_params(shape, tp=1, pp=2)
    emb = shape.llama.vocab_size * shape.llama.hidden_size
    assert sum(r.total for r in ranks) == total + emb       # the tied table lives on both ends
    assert [r.tied_copies for r in ranks] == [emb, emb]
    assert ranks[0].has_embedding and not ranks[0].has_head and ranks[1].has_head
    tp = rank_params(shape, tp=2)[0]
    norms = sum(p.numel() for n, p in shape.module.named_parameters() if "norm" in n)
    assert tp.total == (total - norms) // 2 + norms


def test_pipeline_in_flight_micro_batches_scale_activations():
    base = Layout(pp=4, grad_accum=8, micro_batch=1, seq_len=64, precision="fp32")
    one_f = estimate_layout("tiny", base)
    gpipe = estimate_layout("tiny", base.replace(schedule="gpipe"))
    act = lambda e: next(i.device for i in e.items if i.name == "activations")  # noqa: E731
    assert one_f.rank == 0 and act(gpipe) > act(one_f)      # 1F1B: rank 0 holds p = 4 micro-batches, GPipe m = 8


def test_sources_of_a_model(tmp_path):
    cfg = build_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    a = estimate(tmp_path, {"zero_optimization": {"stage": 2}}, gpus=2)
    b = estimate("tiny", {"zero_optimization": {"stage": 2}}, gpus=2)
    with torch.device("meta"):
        module = Llama(cfg)
    c = estimate(module, {"zero_optimization": {"stage": 2}}, gpus=2)
    assert a.peak == b.peak == c.peak and a.n_params == cfg.num_params()
    seq = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to("meta")
    d = estimate(seq, {}, gpus=1)
    assert d.model_states["params"] == (64 * 64 + 64 + 64 * 8 + 8) * 4
    act = [i for i in d.items if i.name == "activations"]      # unknown for a module that is not a Llama: said
    assert len(act) == 1 and act[0].device == 0 and act[0].note.startswith("NOT PRICED")


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown model preset 'tinny'.*did you mean 'tiny'"):
        estimate("tinny", {})
    with pytest.raises(ValueError, match="3 GPUs cannot hold tensor_parallel.size 2"):
        estimate("tiny", {"tensor_parallel": {"size": 2}}, gpus=3)
    with pytest.raises(ValueError, match="tensor_parallel.size 3 does not divide"):
        estimate("tiny", {"tensor_parallel": {"size": 3}}, gpus=3)
    with pytest.raises(FileNotFoundError, match="without a config.json"):
        estimate("/", {})


def test_pipeline_zero3_memory_follows_the_gather_policy():
    """Whole gradients through a pipeline's schedule at ZeRO-2/3; ZeRO-3 with `schedule` keeps the stage's
    weights gathered, with `micro_batch` one block (and its prefetch) at a time."""
    base = dict(dp=2, pp=2, grad_accum=4, micro_batch=1, seq_len=128, precision="bf16")
    micro = estimate_layout("7b", Layout(zero=3, **base))
    whole = estimate_layout("7b", Layout(zero=3, pipeline_gather="schedule", **base))
    zero1 = estimate_layout("7b", Layout(zero=1, **base))

    def item(est, name):
        return sum(i.device for i in est.items if i.name == name)
    assert item(micro, "schedule gradients") == item(whole, "schedule gradients") > 0
    assert item(whole, "ZeRO-3 gathered") > 5 * item(micro, "ZeRO-3 gathered")
    assert micro.peak < whole.peak and micro.peak < zero1.peak


def test_model_states_are_kept_per_rank_and_settings_and_handed_out_as_copies():
    """memory/theory.model_states keeps its figures on the rank's parameters (the planner prices thousands of
    layouts over a few ranks): the same settings give the same bytes, other settings their own, and a caller that
    changes what it got changes nothing kept."""
    from bunsan.memory.theory import model_states
    rp = rank_params(load_shape("tiny"), 1, 1, 1)[0]
    first = model_states(rp, 2, 3, 2, "AdamW", {"betas": [0.9, 0.95]}, offload_optimizer="nvme")
    first["params"], first["on_disk"]["master_weights"] = -1.0, -1.0
    again = model_states(rp, 2, 3, 2, "AdamW", {"betas": [0.9, 0.95]}, offload_optimizer="nvme")
    assert again["params"] > 0 and again["on_disk"]["master_weights"] > 0
    assert model_states(rp, 4, 3, 2, "AdamW")["params"] == pytest.approx(again["params"] / 2, rel=0.01)
    assert model_states(rp, 2, 1, 2, "AdamW")["params"] == pytest.approx(2 * again["params"], rel=0.01)
