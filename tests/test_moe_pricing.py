"""A MoE Llama priced: its blocks' saved tensors, its model states under expert parallelism (against the engine's own
report), the step's all-to-alls, and `bunsan plan` proposing expert-parallel layouts for a Mixtral config.json."""

import dataclasses
import json

import pytest
import torch

from bunsan.config import Config
from bunsan.estimator import estimate, estimate_layout, load_shape
from bunsan.estimator.activations import Micro, block_bytes
from bunsan.estimator.hardware import gpu_spec, interconnect, intra_link
from bunsan.estimator.layout import Layout
from bunsan.models import Llama
from bunsan.models.llama import LlamaConfig
from bunsan.models.presets import build_config
from bunsan.planner.cost import step_time
from test_estimator import _saved_bytes

# (what the MoE block is given) -> the saved-tensor terms it exercises (estimator/activations.py moe_bytes)
BLOCKS = {
    "routed only": {},
    "shared experts": {"num_shared_experts": 1},
    "sigmoid, z-loss": {"score_func": "sigmoid", "z_loss_coef": 1e-3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", BLOCKS)
def test_a_moe_blocks_activations_are_what_autograd_saves(dtype, name):
    """Two depths isolate one block: its saved bytes equal the formula, dropless (every routed row computed)."""
    saved = {}
    for layers in (1, 2):
        moe = {**build_config("tiny-moe").moe, **BLOCKS[name], "expert_kernel": "loop"}
        cfg = build_config("tiny-moe", num_hidden_layers=layers, vocab_size=512, moe=moe)
        torch.manual_seed(0)
        saved[layers] = _saved_bytes(Llama(cfg).to(dtype), torch.randint(0, 512, (3, 40)), False)
    assert saved[2] - saved[1] == block_bytes(cfg, Micro(3, 40, dtype.itemsize, device="cpu"))


def test_under_a_capacity_factor_the_price_is_the_bound_of_what_is_kept():
    saved = {}
    for layers in (1, 2):
        moe = {**build_config("tiny-moe").moe, "capacity_factor": 1.0, "expert_kernel": "loop"}
        cfg = build_config("tiny-moe", num_hidden_layers=layers, vocab_size=512, moe=moe)
        torch.manual_seed(0)
        saved[layers] = _saved_bytes(Llama(cfg), torch.randint(0, 512, (3, 40)), False)
    dropless = dataclasses.replace(cfg, moe={**cfg.moe, "capacity_factor": None})
    m = Micro(3, 40, 4, device="cpu")
    assert saved[2] - saved[1] <= block_bytes(cfg, m) <= block_bytes(dropless, m)
    tight = dataclasses.replace(cfg, moe={**cfg.moe, "capacity_factor": 0.5})
    assert block_bytes(tight, m) < block_bytes(cfg, m)      # half the rows kept: half the experts' tensors


def test_selective_recompute_of_a_moe_block_is_refused_not_mispriced():
    with pytest.raises(ValueError, match="selective recompute of a MoE block is not priced"):
        estimate_layout("tiny-moe", Layout(checkpointing="selective", seq_len=64))


# -- model states under expert parallelism ---------------------------------------------------------------
def _expert_elems(cfg: LlamaConfig) -> int:
    moe = cfg.moe_config()
    return cfg.num_hidden_layers * moe.num_experts * 3 * cfg.hidden_size * moe.expert_intermediate_size


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_parallelism_splits_the_experts_states_over_ep_and_shards_them_over_the_rest(zero):
    """fp32 SGD without momentum: params and grads only, so the bytes are the formula's to the padding."""
    shape = load_shape("tiny-moe")
    experts, total = _expert_elems(shape.llama), shape.n_params
    dense = total - experts
    lay = Layout(dp=4, ep=2, zero=zero, precision="fp32", optimizer="SGD", seq_len=64)
    got = estimate_layout(shape, lay).model_states
    per_rank = {0: lambda n, g: 2 * n, 1: lambda n, g: 2 * n, 2: lambda n, g: n + n / g,
                3: lambda n, g: 2 * n / g}[zero]
    want = 4 * (per_rank(dense, 4) + per_rank(experts / 2, 2))
    assert got["params"] + got["grads"] == pytest.approx(want, rel=2e-3)
    whole = estimate_layout(shape, lay.replace(ep=1)).model_states
    if zero == 3:       # 1/ep of the experts sharded over dp/ep ranks: each rank's 1/dp of them, as without ep
        assert got["model_states"] == pytest.approx(whole["model_states"], rel=2e-3)
    else:
        assert got["model_states"] < whole["model_states"]


def _measured_states(rank: int, cfg: dict) -> float:
    import bunsan
    torch.manual_seed(0)
    engine = bunsan.initialize(Llama(build_config("tiny-moe", vocab_size=512)), cfg)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank))
    engine.train_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return engine.memory_report()["model_states"]


@pytest.mark.parametrize("zero", [0, 3])
def test_the_estimated_model_states_under_ep2_are_the_engines(pools, zero):
    cfg = {"train_micro_batch_size_per_gpu": 2, "data": {"seq_len": 32}, "zero_optimization": {"stage": zero},
           "expert_parallel": {"enabled": True, "autoep_size": 2}, "optimizer": {"type": "AdamW"}}
    measured = pools.run(2, _measured_states, cfg)
    est = estimate(build_config("tiny-moe", vocab_size=512), Config.load(cfg), gpus=2, device_type="cpu")
    for got in measured:
        assert est.model_states["model_states"] == pytest.approx(got, rel=0.05)


def test_a_layout_whose_ep_does_not_fold_over_dp_x_cp_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"Layout.ep 4 does not divide dp 2 x cp 1 = 2"):
        Layout(dp=2, ep=4)
    with pytest.raises(ValueError, match="ep 3 does not divide the 4 experts"):
        estimate_layout("tiny-moe", Layout(dp=3, ep=3, seq_len=64))
    with pytest.raises(ValueError, match="is not one: estimate it with ep 1"):
        estimate_layout("tiny", Layout(dp=2, ep=2, seq_len=64))


def test_an_expert_parallel_layout_writes_the_config_that_runs_it():
    lay = Layout(dp=4, ep=2, zero=1, seq_len=64)
    cfg = Config.load(lay.to_config())
    assert cfg.expert_parallel.size == 2
    assert Layout.from_config(cfg, 4) == lay
    assert "ep2" in lay.describe()


# -- the step: experts' GEMMs, the all-to-alls, the experts' gradients over their own group -----------------
MIXTRAL = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                      moe={"num_experts": 8, "top_k": 2, "expert_intermediate_size": 14336, "route_norm": True})


def _step(layout: Layout, per_node: int = 8):
    gpu = gpu_spec("h100")
    return step_time(MIXTRAL, layout, gpu, intra_link(gpu), interconnect("infiniband"), per_node)


def test_the_all_to_alls_grow_with_ep_and_cost_more_across_nodes():
    lay = Layout(dp=16, ep=1, zero=1, micro_batch=1, grad_accum=2, seq_len=4096)
    one, two, eight = _step(lay), _step(lay.replace(ep=2)), _step(lay.replace(ep=8))
    assert one.ep_comm == 0 and 0 < two.ep_comm < eight.ep_comm
    across = _step(lay.replace(ep=8), per_node=4)         # eight ranks over two nodes: the network bounds them
    assert across.ep_comm > 2 * eight.ep_comm
    # every token computes top_k experts whatever ep is: the FLOPs counted are the active parameters'
    assert one.flops_per_token == two.flops_per_token
    assert one.flops_per_token < 6 * MIXTRAL.num_params(include_embedding=False) / 2


def test_the_experts_gradients_reduce_over_fewer_ranks_under_ep():
    lay = Layout(dp=16, zero=2, micro_batch=1, grad_accum=1, seq_len=4096)
    assert _step(lay.replace(ep=8)).dp_comm_total < _step(lay).dp_comm_total


def test_a_capacity_factor_caps_the_rows_the_experts_compute():
    capped = dataclasses.replace(MIXTRAL, moe={**MIXTRAL.moe, "capacity_factor": 0.5})
    lay = Layout(dp=8, ep=8, zero=1, micro_batch=1, grad_accum=1, seq_len=4096)
    gpu = gpu_spec("h100")
    full = step_time(MIXTRAL, lay, gpu, intra_link(gpu), interconnect("infiniband"), 8)
    half = step_time(capped, lay, gpu, intra_link(gpu), interconnect("infiniband"), 8)
    # (the rows halve; the per-peer latency steps of each all-to-all stay)
    assert half.compute < full.compute and full.ep_comm / 2 < half.ep_comm < 0.65 * full.ep_comm


# -- bunsan plan on a Mixtral config.json -------------------------------------------------------------------
def test_bunsan_plan_proposes_expert_parallel_layouts_for_a_mixtral_and_prices_them(tmp_path, capsys):
    from bunsan.cli.main import main
    hf = {**MIXTRAL.to_hf(), "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    # (a narrowed search: the full one walks ~120k layouts; test_planner_space checks the walk itself)
    main(["plan", "--model", str(tmp_path), "--gpus", "64", "--gpu", "h100", "--json", "--top", "5",
          "--zero-stages", "1,3", "--recompute", "none", "--no-sp", "--no-activation-offload", "--cp-sizes", "1",
          "--precision", "bf16"])
    plan = json.loads(capsys.readouterr().out)
    ranked = plan["ranked"]
    assert plan["model"] == tmp_path.name and not plan["not_searched"]     # bunsan's MoE Llama: every dimension
    assert ranked and all(r["step_seconds"] is not None for r in ranked)
    assert ranked[0]["layout"]["ep"] > 1 and ranked[0]["step_seconds"]["ep_comm"] > 0
    only = ["plan", "--model", str(tmp_path), "--gpus", "64", "--gpu", "h100", "--json", "--top", "3",
            "--zero-stages", "1", "--recompute", "none", "--no-sp", "--no-activation-offload", "--cp-sizes", "1",
            "--precision", "bf16", "--ep-sizes", "1"]
    main(only)
    assert all(r["layout"]["ep"] == 1 for r in json.loads(capsys.readouterr().out)["ranked"])


# -- a published MoE run (tests/published_moe.py) -------------------------------------------------------------
@pytest.mark.parametrize("gpus", [8, 16, 32, 64, 128, 256, 512, 1024, 2048])
def test_nvidias_grok1_steps_on_h100_are_priced_within_15_percent(gpus):
    import published_moe as pm
    _, step, measured = pm.priced(gpus)
    assert abs(step.total / measured - 1) <= 0.15, f"{gpus} GPUs: priced {step.total:.2f} s, measured {measured} s"
    assert step.ep_comm > 0
