"""transformers' own MoE models, unchanged, under bunsan's tensor parallelism by their own plans ("moe_tp_experts"
with "packed_colwise" and "rowwise" experts: tensor_parallel/hf_moe.py) against the plain single-process loop:
SGD without clipping, fp32, rtol 1e-5, with each model's router auxiliary loss in the loss where it has one."""

from __future__ import annotations

import pytest
import torch

import bunsan
from parity import check_runs

transformers = pytest.importorskip("transformers")

ROWS, SEQ, VOCAB, STEPS, LR = 4, 12, 64, 3, 0.5
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
# family -> (config class, model class, its MoE fields): each kept case says what it adds
FAMILIES = {
    # routed experts only, softmax top-2 renormalised, Switch auxiliary loss
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     router_aux_loss_coef=0.02)),
    # a shared expert with its sigmoid gate beside the routed ones, top-k not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                       num_experts=4, num_experts_per_tok=2, output_router_logits=True)),
    # q/k norms, a dense MLP layer (mlp_only_layers) beside a MoE one: the dense one is split as a dense MLP
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[0], norm_topk_prob=True, output_router_logits=True, head_dim=8)),
    # attention split by columns with gathered outputs (OLMoE's own plan), q/k norms over the whole width
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=24, num_experts=4, num_experts_per_tok=2, output_router_logits=True)),
    # sigmoid scores with a selection bias, groups, shared experts, a dense first layer; MLA attention whole
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                         routed_scaling_factor=2.5)),
}


def tiny(family: str, starved: tuple = (), **changes):
    """The family's tiny model; `starved`: experts DeepSeek-V3's selection bias keeps every token from."""
    config_cls, model_cls, moe = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **(moe | changes)))
    gate = model.model.layers[-1].mlp.gate
    if hasattr(gate, "e_score_correction_bias"):    # a bias that picks experts, as a trained model has
        bias = torch.linspace(-0.5, 0.5, gate.e_score_correction_bias.numel())
        bias[list(starved)] = -100.0
        gate.e_score_correction_bias.copy_(bias)
    return model


def data() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)), "labels": ids}
            for _ in range(STEPS)]


def reference(family: str, batches: list[dict], dp: int = 1, **changes):
    """The plain loop; `dp` > 1: the auxiliary loss as bunsan's data-parallel ranks add it, the mean of each
    rank's rows' (the balancing loss of a batch is not the mean of its halves')."""
    model = tiny(family, **changes)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    coef = getattr(model.config, "router_aux_loss_coef", 0.0)
    losses = []
    for b in batches:
        if dp == 1 or not getattr(model.config, "output_router_logits", False):
            loss = model(**b).loss          # (with the auxiliary loss where the model adds it)
        else:
            per = ROWS // dp
            parts = [model(**{k: v[r * per:(r + 1) * per] for k, v in b.items()}).aux_loss for r in range(dp)]
            loss = model(**b, output_router_logits=False).loss + coef * torch.stack(parts).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(rank, family, cfg, batches, changes=None):
    """Worker: `family`'s tiny model (with `changes`) under `cfg`; (losses, consolidated state, what this rank
    holds: the split modules' classes and every experts' gate_up_proj shape)."""
    engine = bunsan.initialize(tiny(family, **(changes or {})), cfg)
    losses = [engine.train_batch(_rows(engine, b)) for b in batches]
    split = sorted({type(m).__name__ for m in engine.module.modules() if hasattr(m, "tp_split")})
    held = {n: tuple(p.shape) for n, p in engine.module.named_parameters() if n.endswith("experts.gate_up_proj")}
    return losses, engine.consolidated_state_dict(), {"split": split, "held": held}


def _rows(engine, b: dict) -> dict:
    per = ROWS // engine.mesh.dp
    return {k: v[engine.mesh.dp_rank * per:(engine.mesh.dp_rank + 1) * per] for k, v in b.items()}


def _cfg(zero: int = 0) -> dict:
    return {"train_batch_size": ROWS, "steps_per_print": 100, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": zero}, "tensor_parallel": {"size": 2}}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_moe_under_tp2_matches_the_plain_loop(pools, family):
    batches = data()
    results = pools.run(2, _train, family, _cfg(), batches)
    ref_losses, ref_state = reference(family, batches)
    check_runs([(r[0], r[1], None) for r in results], ref_losses, ref_state)
    assert any(name.endswith(("Experts", "NaiveMoe")) for name in results[0][2]["split"]), results[0][2]


def test_tp2_on_zero3(pools):
    """The split experts under ZeRO-3's gathered units."""
    batches = data()
    results = pools.run(2, _train, "mixtral", _cfg(3), batches)
    check_runs([(r[0], r[1], None) for r in results], *reference("mixtral", batches))


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["dp2", "tp2_x_dp2"])
def test_the_auxiliary_loss_under_data_parallelism_is_each_ranks_rows(pools, world, tp):
    batches = data()
    results = pools.run(world, _train, "mixtral", {**_cfg(1), "tensor_parallel": {"size": tp}}, batches)
    check_runs([(r[0], r[1], None) for r in results], *reference("mixtral", batches, dp=world // tp))


def test_a_router_with_jitter_noise_is_refused_under_tp():
    from bunsan.comm.collectives import Comm
    from bunsan.comm.work import Group
    from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
    model = tiny("mixtral")
    model.config.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match="router jitter noise"):
        apply_tensor_parallel(model, TPContext(Comm(), Group("tp", None, 2, 0, (0, 1))))


def _train_pp(rank, family, cfg, batches):
    engine = bunsan.initialize(tiny(family), cfg)
    return [engine.train_batch(b) for b in batches]


def test_pipeline_stages_refuse_a_router_loss_they_cannot_carry(pools):
    """The last stage's output is logits only: a model that counts its router's loss is refused, not trained
    without it."""
    cfg = {**_cfg(0), "tensor_parallel": {"size": 1}, "pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}
    with pytest.raises(AssertionError, match="returned no aux_loss"):
        pools.run(2, _train_pp, "mixtral", cfg, data())


# -- expert parallelism by the model's ep_plan (expert_parallel/hf_experts.py) --------------------------------
def _ep_cfg(zero: int = 0) -> dict:
    return {"train_batch_size": ROWS, "steps_per_print": 100, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": zero}, "expert_parallel": {"enabled": True, "autoep_size": 2}}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_moe_under_ep2_matches_the_plain_loop(pools, family):
    batches = data()
    results = pools.run(2, _train, family, _ep_cfg(), batches)
    check_runs([(r[0], r[1], None) for r in results], *reference(family, batches, dp=2))
    for held in (r[2]["held"] for r in results):          # each rank holds 2 of the 4 experts
        assert held and all(shape[0] == 2 for shape in held.values()), held


# the layouts beside EP 2 alone: (family, world, config changes, model changes), each case saying what it adds
NO_AUX = {"output_router_logits": False}      # (a pipeline's last stage returns logits only)
EP_LAYOUTS = {
    "qwen3_moe ep2 zero1": ("qwen3_moe", 2, {"zero_optimization": {"stage": 1}}, {}),
    # ZeRO-3 gathers each block's experts as a unit of the experts' own strategy
    "mixtral ep2 zero3": ("mixtral", 2, {"zero_optimization": {"stage": 3}}, {}),
    "qwen3_moe ep2 zero3": ("qwen3_moe", 2, {"zero_optimization": {"stage": 3}}, {}),
    # each expert cut both ways (the dispatch outside the tensor-parallel hooks)
    "mixtral ep2 tp2": ("mixtral", 4, {"tensor_parallel": {"size": 2}}, {}),
    "qwen3_moe ep2 tp2": ("qwen3_moe", 4, {"tensor_parallel": {"size": 2}}, {}),
    "deepseek_v3 ep2 tp2": ("deepseek_v3", 4, {"tensor_parallel": {"size": 2}}, {}),
    # a stage's experts found by the plan's paths under the stage's names
    "qwen3_moe ep2 pp2": ("qwen3_moe", 4, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2},
                          {**NO_AUX, "mlp_only_layers": []}),
    "mixtral ep2 pp2": ("mixtral", 4, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}, NO_AUX),
    # the first stage holds the dense layer only: no experts to split there
    "deepseek_v3 ep2 pp2": ("deepseek_v3", 4, {"pipeline": {"stages": 2}, "gradient_accumulation_steps": 2}, {}),
}


@pytest.mark.parametrize("name", EP_LAYOUTS)
def test_a_transformers_moe_on_expert_parallel_layouts_matches_the_plain_loop(pools, name):
    family, world, changes, model_changes = EP_LAYOUTS[name]
    batches = data()
    results = pools.run(world, _train, family, {**_ep_cfg(1), **changes}, batches, model_changes)
    dp = world // changes.get("tensor_parallel", {}).get("size", 1) // changes.get("pipeline", {}).get("stages", 1)
    check_runs([(r[0], r[1], None) for r in results], *reference(family, batches, dp=dp, **model_changes))



# (the router's loss left out: a layout with another data-parallel size balances over other rows)
CKPT_MODEL = {"output_router_logits": False}


def _save(rank, cfg, path):
    engine = bunsan.initialize(tiny("qwen3_moe", **CKPT_MODEL), cfg)
    batches = data()
    for b in batches[:-1]:
        engine.train_batch(_rows(engine, b))
    engine.save_checkpoint(path)
    return engine.train_batch(_rows(engine, batches[-1])), engine.consolidated_state_dict()


def _resume(rank, cfg, path):
    model = tiny("qwen3_moe", **CKPT_MODEL)
    with torch.no_grad():
        for p in model.parameters():        # other weights: the checkpoint must replace every one
            p.add_(0.5)
    engine = bunsan.initialize(model, cfg)
    engine.load_checkpoint(path)
    return engine.train_batch(_rows(engine, data()[-1])), engine.consolidated_state_dict()


def test_ep2_with_a_rank_whose_experts_no_token_chooses(pools):
    """DeepSeek-V3's selection bias keeps every token from experts 2 and 3, rank 1's: it still takes part in every
    all-to-all (nothing waits), and its experts' weights stay as they were."""
    batches = data()
    changes = {"starved": (2, 3)}
    results = pools.run(2, _train, "deepseek_v3", _ep_cfg(3), batches, changes)
    ref_losses, ref_state = reference("deepseek_v3", batches, dp=2, **changes)
    check_runs([(r[0], r[1], None) for r in results], ref_losses, ref_state)
    start = tiny("deepseek_v3", **changes).state_dict()
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(ref_state[key][2:], start[key][2:]) and not torch.equal(ref_state[key][:2], start[key][:2])


def _layout(ep: int, tp: int) -> dict:
    return {**_ep_cfg(1), "expert_parallel": {"enabled": ep > 1, "autoep_size": ep}, "tensor_parallel": {"size": tp}}


# saved on (ranks, EP, TP) -> loaded on (ranks, EP, TP); each case says what it adds
RESHARDS = {
    # each rank's run of experts saved in global coordinates
    "ep2 -> ep1": ((2, 2, 1), (2, 1, 1)),
    "ep1 -> ep2": ((2, 1, 1), (2, 2, 1)),
    # gate_up_proj's gate and up rows, each cut over the ranks: two sections along dim 1
    "tp2 -> dp2": ((2, 1, 2), (2, 1, 1)),
    "dp2 -> tp2": ((2, 1, 1), (2, 1, 2)),
    # each rank a run of experts at half their width: both cuts in one piece
    "ep2 x tp2 -> dp2": ((4, 2, 2), (2, 1, 1)),
}


@pytest.mark.parametrize("name", RESHARDS)
def test_a_checkpoint_of_packed_experts_resumes_on_another_layout(pools, tmp_path, name):
    (save_world, *saved), (load_world, *loaded) = RESHARDS[name]
    path = str(tmp_path / "ckpt")
    want_loss, want_state = pools.run(save_world, _save, _layout(*saved), path)[0]
    for loss, state in pools.run(load_world, _resume, _layout(*loaded), path):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        for key, want in want_state.items():
            torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-6, msg=key)
