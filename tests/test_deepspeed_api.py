"""bunsan.deepspeed's pieces one by one, in a world of one (the 2-rank scripts are test_deepspeed_compat.py):
what maps to bunsan, and what is refused with a clear error rather than ignored."""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch
import torch.nn as nn

import bunsan.deepspeed as deepspeed
from bunsan.deepspeed.pipe import LayerSpec, PipelineModule

CFG = {"train_batch_size": 2, "steps_per_print": 100, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_every_module_a_script_imports_exists():
    for name in ("accelerator", "checkpointing", "comm", "moe.utils", "moe.layer", "ops.adam", "pipe",
                 "runtime.utils", "utils", "zero"):
        importlib.import_module(f"bunsan.deepspeed.{name}")
    assert callable(deepspeed.initialize) and callable(deepspeed.init_distributed)


def test_engine_is_a_module_with_deepspeeds_attributes():
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=_mlp(), config=CFG)
    assert isinstance(engine, nn.Module) and loader is None and scheduler is None
    assert optimizer is engine.optimizer
    assert [n for n, _ in engine.named_parameters()] == ["module.0.weight", "module.0.bias", "module.2.weight",
                                                          "module.2.bias"]
    assert list(engine.state_dict()) == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
    engine.eval()
    assert not engine.module.training
    engine.train()
    assert engine.module.training
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 0, 1, 1)
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size(),
            engine.gradient_accumulation_steps(), engine.zero_optimization_stage()) == (2, 2, 1, 0)
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and engine.global_samples == 2 and engine.get_lr() == [0.1]
    assert engine.get_global_grad_norm() > 0 and engine.was_step_applied()
    assert engine.memory_report() is not None      # bunsan's own API stays reachable


def test_configured_scheduler_is_stepped_by_the_engine_only():
    cfg = {**CFG, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 4,
                                                                "warmup_type": "linear"}}}
    engine, _, _, scheduler = deepspeed.initialize(model=_mlp(), config=cfg)
    assert scheduler.get_lr() == engine.get_lr()
    with pytest.raises(RuntimeError, match="advance it twice"):
        scheduler.step()


def test_config_twice_or_missing_is_an_error(tmp_path):
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "ds.json"), local_rank=-1)
    with pytest.raises(ValueError, match="given twice"):
        deepspeed.initialize(args=args, model=_mlp(), config=CFG)
    with pytest.raises(ValueError, match="needs a config"):
        deepspeed.initialize(model=_mlp())


def test_local_rank_must_match_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="LOCAL_RANK=0"):
        deepspeed.initialize(args=argparse.Namespace(local_rank=3), model=_mlp(), config=CFG)


def test_refused_arguments_name_the_alternative():
    with pytest.raises(ValueError, match="mesh"):
        deepspeed.initialize(model=_mlp(), config=CFG, mpu=object())
    with pytest.raises(ValueError, match="environment"):
        deepspeed.init_distributed(init_method="tcp://x:1")
    with pytest.raises(ValueError, match="nccl"):
        deepspeed.init_distributed(dist_backend="ccl")


def test_add_config_arguments():
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", "c.json"])
    assert args.deepspeed and args.deepspeed_config == "c.json"


def test_no_sync_refuses_a_step_inside_and_stage_2():
    engine, *_ = deepspeed.initialize(model=_mlp(), config=CFG)
    with engine.no_sync():
        engine.backward(engine(torch.randn(2, 4)).sum())
        with pytest.raises(RuntimeError, match="inside no_sync"):
            engine.step()
    engine2, *_ = deepspeed.initialize(model=_mlp(), config={**CFG, "zero_optimization": {"stage": 2}})
    with pytest.raises(RuntimeError, match="stage 2"):
        with engine2.no_sync():
            pass


def test_pipeline_module_refusals():
    with pytest.raises(ValueError, match="type:<regex>"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1, partition_method="type:Linear")
    with pytest.raises(ValueError, match="activation_checkpoint_interval"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1, activation_checkpoint_interval=1)
    with pytest.raises(ValueError, match="num_stages"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)])
    with pytest.raises(TypeError, match="nn.Module subclass"):
        LayerSpec(len)


def test_pipeline_engine_refuses_the_micro_batch_loop():
    net = PipelineModule([LayerSpec(nn.Linear, 4, 2)], num_stages=1, loss_fn=nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=net, config=CFG)
    with pytest.raises(RuntimeError, match="train_batch"):
        engine(torch.randn(2, 4))
    loss = engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 2))]))
    assert loss.ndim == 0 and engine.global_steps == 1
    with pytest.raises(ValueError, match="ran out"):
        engine.train_batch(iter([]))


def test_moe_helpers_leave_a_model_without_experts_as_it_is():
    """(DeepSpeed's MoE layer itself: tests/test_deepspeed_moe.py.)"""
    from bunsan.deepspeed.moe.layer import MoE
    from bunsan.deepspeed.moe.utils import has_moe_layers, split_params_into_different_moe_groups_for_optimizer
    params = list(_mlp().parameters())
    assert split_params_into_different_moe_groups_for_optimizer({"params": params}) == [{"params": params}]
    assert has_moe_layers(_mlp()) == (False, 0)
    assert has_moe_layers(MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2)) == (True, 2)


def test_fused_adam_is_torch_adamw_or_adam():
    from bunsan.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    params = list(_mlp().parameters())
    assert type(FusedAdam(params, lr=1e-3, weight_decay=0.1)) is torch.optim.AdamW
    assert type(FusedAdam(params, adam_w_mode=False)) is torch.optim.Adam
    assert type(DeepSpeedCPUAdam(params)) is torch.optim.AdamW
    from bunsan.optim.deepspeed_optimizers import UncorrectedAdam
    uncorrected = FusedAdam(params, bias_correction=False, adam_w_mode=False)
    assert type(uncorrected) is UncorrectedAdam and not uncorrected.defaults["decoupled_weight_decay"]


def test_activation_checkpointing_gives_the_same_gradients():
    from bunsan.deepspeed import checkpointing
    net = _mlp()
    x = torch.randn(3, 4)
    net(x).sum().backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    checkpointing.checkpoint(net, x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, net.parameters()))
    with pytest.raises(ValueError, match="partition_activations"):
        checkpointing.configure(None, partition_activations=True)


def test_accelerator_and_seed():
    from bunsan.deepspeed.accelerator import get_accelerator
    from bunsan.deepspeed.runtime.utils import set_random_seed
    acc = get_accelerator()
    assert acc.device_name() in ("cpu", "cuda") and acc.communication_backend_name() in ("gloo", "nccl")
    set_random_seed(5)
    a = torch.rand(2)
    set_random_seed(5)
    assert torch.equal(a, torch.rand(2))


def test_repeating_loader_restarts():
    from bunsan.deepspeed.utils import RepeatingLoader
    assert [x for x, _ in zip(RepeatingLoader([1, 2]), range(5))] == [1, 2, 1, 2, 1]


def test_gathered_parameters_before_initialize_keeps_the_modifiers_write():
    with deepspeed.zero.Init():
        net = _mlp()
    assert all(p.is_meta for p in net.parameters())
    with deepspeed.zero.GatheredParameters(net[0].weight, modifier_rank=0):
        net[0].weight.data.fill_(0.5)
    with pytest.raises(RuntimeError, match="modifier_rank"):
        with deepspeed.zero.GatheredParameters(net[2].weight):
            net[2].weight.data.fill_(1.0)
    engine, *_ = deepspeed.initialize(model=net, config={**CFG, "zero_optimization": {"stage": 3}})
    state = engine.consolidated_state_dict()
    assert torch.equal(state["0.weight"], torch.full((8, 4), 0.5))
    assert torch.equal(state["2.weight"], _mlp()[2].weight.detach())   # the refused write was not kept


def test_zero_init_keeps_the_modules_own_init_and_buffers():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    plain[1].running_mean.fill_(0.3)
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        net[1].running_mean.fill_(0.3)
    engine, *_ = deepspeed.initialize(model=net, config=CFG)     # stage 0: materialised whole
    state = engine.consolidated_state_dict()
    for k, v in plain.state_dict().items():
        assert torch.equal(state[k], v), k


def test_fp16_auto_cast_gives_the_half_model_half_inputs():
    """DeepSpeed's fp16.auto_cast: the float32 inputs of the script's forward reach the float16 model as
    float16 (inside lists and dicts too; token ids and keyword arguments as they are). Without it the same
    call is the model's own dtype error, as in DeepSpeed."""
    from bunsan.engine.precision import half_inputs
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    seen = []
    model = _mlp()
    model[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    reference = _mlp().half()
    engine, *_ = deepspeed.initialize(model=model, config={**CFG, "fp16": {
        "enabled": True, "auto_cast": True, "initial_scale_power": 4}})
    out = engine(x)
    assert seen == [torch.float16] and out.dtype == torch.float16
    assert torch.equal(out, reference(x.half()))
    loss = nn.functional.mse_loss(out.float(), y)
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    assert not torch.equal(engine(x), out)
    nested = half_inputs(([x, torch.arange(3)], {"a": x.double(), "mask": torch.ones(2, dtype=torch.bool)}))
    assert nested[0][0].dtype == nested[1]["a"].dtype == torch.float16
    assert nested[0][1].dtype == torch.int64 and nested[1]["mask"].dtype == torch.bool
    plain, *_ = deepspeed.initialize(model=_mlp(), config={**CFG, "fp16": {"enabled": True}})
    with pytest.raises(RuntimeError, match="dtype|Half|Float"):
        plain(x)


def test_the_optimizer_says_whether_its_last_step_overflowed():
    """DeepSpeed's fp16 optimizers carry `overflow`, which DeepSpeed-Chat's PPO loop reads after every step: at a
    loss scale of 2**24 this MLP's fp16 gradients overflow and the step is skipped; at 2**4 it applies."""
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    for power, overflowed in ((24, True), (4, False)):
        engine, optimizer, *_ = deepspeed.initialize(model=_mlp(), config={**CFG, "fp16": {
            "enabled": True, "auto_cast": True, "initial_scale_power": power}})
        assert optimizer.overflow is False           # before any step, as DeepSpeed's
        engine.backward(nn.functional.mse_loss(engine(x).float(), y))
        engine.step()
        assert optimizer.overflow is overflowed and engine.was_step_applied() is not overflowed
