"""DeepSpeed scripts (tests/ds_scripts.py, only their imports changed) on 2 ranks against plain loops in one
process from the same weights and data: SGD without clipping (a uniform gradient-scale error shows), fp32,
rtol 1e-5."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DistributedSampler, TensorDataset

import ds_scripts
from bunsan.deepspeed.runtime.utils import set_random_seed

RTOL = 1e-5


def _close(a, b, what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-7), f"{what} [{i}]: {x} vs {y}"


def _same_state(state: dict, ref: nn.Module, what: str) -> None:
    want = ref.state_dict()
    assert set(state) == set(want), what
    for k in want:
        torch.testing.assert_close(state[k], want[k].float(), rtol=RTOL, atol=1e-6, msg=f"{what}: {k}")


def _images(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


# -- cifar10_deepspeed.py --------------------------------------------------------------------------------
def _cifar_reference(trainset, lr: float, micro: int, world: int = 2):
    set_random_seed(ds_scripts.SEED)
    net = ds_scripts.Net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    order = [list(DistributedSampler(trainset, num_replicas=world, rank=r)) for r in range(world)]
    losses = [[] for _ in range(world)]
    for step in range(len(order[0]) // micro):
        total = 0
        for r in range(world):
            x, y = trainset[order[r][step * micro:(step + 1) * micro]]
            loss = F.cross_entropy(net(x), y)
            losses[r].append(loss.item())
            total = total + loss / world
        opt.zero_grad()
        total.backward()
        opt.step()
    return losses, net


@pytest.mark.parametrize("stage,moe_groups", [(0, False), (1, True), (2, False), (3, True)])
def test_cifar_script_matches_a_plain_loop(pools, stage, moe_groups):
    trainset = _images()
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
           "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "zero_optimization": {"stage": stage}}
    argv = ["--deepspeed"] + (["--moe-param-group"] if moe_groups else [])
    results = pools.run(2, _cifar_rank, 2, trainset, cfg, argv)
    ref_losses, ref = _cifar_reference(trainset, 0.05, 4)
    for r, (losses, state, steps, samples, outputs) in enumerate(results):
        _close(losses, ref_losses[r], f"stage {stage} rank {r} losses")
        _same_state(state, ref, f"stage {stage} rank {r} weights")
        assert steps == 4 and samples == 32
        with torch.no_grad():
            torch.testing.assert_close(outputs, ref(trainset[:4][0]), rtol=RTOL, atol=1e-6)


def _cifar_rank(rank, world, trainset, cfg, argv):
    return ds_scripts.main_cifar(rank, trainset, cfg, argv)


def test_config_from_args_deepspeed_config(pools, tmp_path):
    import json
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}}))
    trainset = _images()
    results = pools.run(2, _cifar_from_args, 2, trainset, ["--deepspeed", "--deepspeed_config", str(path)])
    ref_losses, _ = _cifar_reference(trainset, 0.05, 4)
    _close(results[0][0], ref_losses[0], "args.deepspeed_config losses")


def _cifar_from_args(rank, world, trainset, argv):
    return ds_scripts.main_cifar(rank, trainset, None, argv)


# -- pipeline_parallelism/train.py -----------------------------------------------------------------------
def _pipe_data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.sin(x * 2))


def _pipe_reference(trainset, steps: int, micro: int, gas: int, lr: float, built: bool = False):
    if built:
        net = nn.Sequential(*(m if isinstance(m, nn.Module) else ds_scripts.PipelineModule([m], 1)[0]
                              for m in ds_scripts.join_layers()))
    else:
        net = ds_scripts.PipelineModule(layers=ds_scripts.pipe_layers(), loss_fn=nn.MSELoss(), num_stages=1)
        net.to_empty(device="cpu")
        net.init_weights()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    order = list(DistributedSampler(trainset, num_replicas=1, rank=0))
    n_micro = len(order) // micro
    draw = (order[(i % n_micro) * micro:((i % n_micro) + 1) * micro] for i in range(steps * gas))
    losses = []
    for _ in range(steps):
        total = 0
        for _ in range(gas):
            x, y = trainset[next(draw)]
            total = total + F.mse_loss(net(x), y) / gas
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(total.item())
    x, y = trainset[:4]
    return losses, F.mse_loss(net(x), y).item(), net


@pytest.mark.parametrize("built", [False, True], ids=["layer-specs", "built-modules"])
def test_pipeline_script_matches_a_plain_loop(pools, built):
    trainset = _pipe_data()
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    results = pools.run(2, _pipe_rank, 2, trainset, cfg, 6, built)
    ref_losses, ref_eval, ref = _pipe_reference(trainset, 6, 2, 4, 0.1, built)
    for r, (losses, held_out, state) in enumerate(results):
        _close(losses, ref_losses, f"pipeline rank {r} losses")
        assert math.isclose(held_out, ref_eval, rel_tol=RTOL)
        _same_state(state, ref, f"pipeline rank {r} weights")


def _pipe_rank(rank, world, trainset, cfg, steps, built):
    return ds_scripts.main_pipeline(rank, trainset, cfg, steps, num_stages=2, built=built)


def test_pipeline_module_weights_do_not_depend_on_the_stage_count():
    one = ds_scripts.PipelineModule(layers=ds_scripts.pipe_layers(), num_stages=1)
    two = ds_scripts.PipelineModule(layers=ds_scripts.pipe_layers(), num_stages=2)
    for net in (one, two):
        net.to_empty(device="cpu")
        net.init_weights()
    for (name, a), (_, b) in zip(one.state_dict().items(), two.state_dict().items()):
        assert torch.equal(a, b), name
    assert one[0].module is one[8].module      # the tied spec is one module


# -- ZeRO-3, zero.Init, GatheredParameters, checkpoints ---------------------------------------------------
def _zero3_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(6, 4, 8, generator=g), torch.randn(6, 4, 4, generator=g)


WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}


def _ds_warmup_lr(k: int) -> float:
    """DeepSpeed 0.19's WarmupLR at optimizer step k (0-based): its scheduler starts at iteration -1 and the
    engine steps it after each step, so step k runs at iteration k - 1; gamma = iteration / warmup_num_steps
    for a linear warm-up (0 before iteration 0)."""
    it = k - 1
    if it < 0:
        return 0.0
    return WARMUP["warmup_min_lr"] + (WARMUP["warmup_max_lr"] - WARMUP["warmup_min_lr"]) * \
        min(1.0, it / WARMUP["warmup_num_steps"])


def _zero3_reference(data, steps: int):
    set_random_seed(ds_scripts.SEED)   # rank 0's seed: Init keeps rank 0's values
    net = ds_scripts.MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    x, y = data
    losses, snapshots = [], {}
    for step in range(steps):
        opt.param_groups[0]["lr"] = _ds_warmup_lr(step)
        losses.append([F.mse_loss(net(x[step][r * 2:(r + 1) * 2]), y[step][r * 2:(r + 1) * 2]).item()
                       for r in range(2)])
        opt.zero_grad()
        F.mse_loss(net(x[step]), y[step]).backward()    # (equal rows per rank: the mean of the two means)
        opt.step()
        snapshots[step + 1] = {k: v.clone() for k, v in net.state_dict().items()}
    return losses, snapshots


def test_zero3_script_init_gathered_parameters_and_checkpoints(pools, tmp_path):
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": WARMUP},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    data = _zero3_data()
    results = pools.run(2, _zero3_rank, 2, data, cfg, str(tmp_path))
    ref_losses, snapshots = _zero3_reference(data, 6)
    for r, out in enumerate(results):
        _close(out["losses"], [step[r] for step in ref_losses], f"rank {r} losses")
        _close(out["lrs"], [_ds_warmup_lr(k + 1) for k in range(6)], f"rank {r} lrs after each step")
        assert out["client_state"] == {"step": 2} and out["steps_at_load"] == 3 and out["stage"] == 3
        for k, v in snapshots[3].items():
            torch.testing.assert_close(out["state_at_load"][k], v, rtol=RTOL, atol=1e-6)
        assert torch.equal(out["bias"], torch.full((4,), 0.25))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["fc2.bias"], torch.full((4,), 0.25))
    torch.testing.assert_close(saved["fc1.weight"], snapshots[3]["fc1.weight"], rtol=RTOL, atol=1e-6)


def _zero3_rank(rank, world, data, cfg, save_dir):
    return ds_scripts.main_zero3(rank, data, cfg, save_dir)


# -- client optimizer and scheduler callables, parameter groups, no_sync ---------------------------------
def _client_reference(data):
    set_random_seed(ds_scripts.SEED)
    net = ds_scripts.MLP()
    opt = torch.optim.SGD([{"params": [net.fc1.weight, net.fc2.weight], "weight_decay": 0.1},
                           {"params": [net.fc1.bias, net.fc2.bias], "weight_decay": 0.0}], lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x, y = data
    losses = [[], []]
    for step in range(x.shape[0]):
        total = 0
        for r in range(2):
            xs, ys = x[step][r * 4:(r + 1) * 4], y[step][r * 4:(r + 1) * 4]
            first, second = F.mse_loss(net(xs[:2]), ys[:2]), F.mse_loss(net(xs[2:]), ys[2:])
            losses[r].append((first.item() + second.item()) / 2)
            total = total + (first + second) / 2
        opt.zero_grad()
        total.backward()
        opt.step()
        sched.step()
    return losses, net


@pytest.mark.parametrize("stage", [0, 1])
def test_client_optimizer_scheduler_groups_and_no_sync(pools, stage):
    g = torch.Generator().manual_seed(3)
    data = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 4, generator=g)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
           "zero_optimization": {"stage": stage}}
    results = pools.run(2, _client_rank, 2, data, cfg)
    ref_losses, ref = _client_reference(data)
    for r, (losses, state) in enumerate(results):
        _close(losses, ref_losses[r], f"stage {stage} rank {r} losses")
        _same_state(state, ref, f"stage {stage} rank {r} weights")


def _client_rank(rank, world, data, cfg):
    return ds_scripts.main_client(rank, data, cfg)


@pytest.mark.parametrize("stage", [0, 2])
def test_client_scheduler_resumes_at_its_rate(pools, tmp_path, stage):
    """The first step after load_checkpoint runs at the rate the scheduler had reached, not the rate the
    optimizer was built with (SGD with momentum: a wrong rate at step 3 shows in every later loss)."""
    g = torch.Generator().manual_seed(4)
    data = torch.randn(5, 8, 8, generator=g), torch.randn(5, 8, 4, generator=g)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
           "zero_optimization": {"stage": stage}}
    whole = pools.run(2, _client_resume_rank, 2, data, cfg, str(tmp_path), "all")
    pools.run(2, _client_resume_rank, 2, data, cfg, str(tmp_path), "save")
    resumed = pools.run(2, _client_resume_rank, 2, data, cfg, str(tmp_path), "load")
    for r, ((losses, lrs), (rest, rest_lrs)) in enumerate(zip(whole, resumed)):
        _close(rest, losses[2:], f"stage {stage} rank {r} losses after the resume")
        assert rest_lrs == pytest.approx(lrs, rel=1e-12) == [0.2 / 6]


def _client_resume_rank(rank, world, data, cfg, save_dir, mode):
    return ds_scripts.main_client_resume(rank, data, cfg, save_dir, mode)
