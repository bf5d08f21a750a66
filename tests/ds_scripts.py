"""DeepSpeed user scripts, written as DeepSpeedExamples writes them, with only their import lines changed
(`import deepspeed` -> `import bunsan.deepspeed as deepspeed`, `from deepspeed.X` -> `from bunsan.deepspeed.X`).

Each `main_*` is what a rank runs (`rank` and the data come from the test); it returns what the test checks
against a plain single-process loop (tests/test_deepspeed_compat.py).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import bunsan.deepspeed as deepspeed
import bunsan.deepspeed.comm as dist
from bunsan.deepspeed.accelerator import get_accelerator
from bunsan.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from bunsan.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from bunsan.deepspeed.runtime.utils import set_random_seed
from bunsan.deepspeed.utils import RepeatingLoader

SEED = 1138


# -- training/cifar/cifar10_deepspeed.py ---------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def cifar_args(argv: list[str]):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main_cifar(rank, trainset, ds_config: dict, argv: list[str]):
    args = cifar_args(argv)
    deepspeed.init_distributed()
    set_random_seed(SEED)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    assert local_rank == rank and model_engine.global_rank == rank
    with torch.no_grad():     # the script tests with `net` itself, not the engine
        images = trainset[:4][0]
        if target_dtype is not None:
            images = images.to(target_dtype)
        outputs = net(images.to(local_device)).float()
    state = {k: v.float() for k, v in model_engine.consolidated_state_dict().items()}
    return losses, state, model_engine.global_steps, model_engine.global_samples, outputs


# -- training/pipeline_parallelism/train.py -------------------------------------------------------------
def tied_head(module, x):
    return F.linear(x, module.weight)


def pipe_layers():
    return [
        TiedLayerSpec("embed", nn.Linear, 8, 8, bias=False),
        LayerSpec(nn.Linear, 8, 32),
        lambda x: torch.tanh(x),
        LayerSpec(nn.Linear, 32, 8),
        LayerSpec(nn.Linear, 8, 8),
        nn.ReLU(inplace=True),            # the first layer of stage 2 (uniform: 5 + 4 layers): fed a received
        LayerSpec(nn.Linear, 8, 32),      # activation, which must not be modified in place
        LayerSpec(nn.Linear, 32, 8),
        TiedLayerSpec("embed", nn.Linear, 8, 8, bias=False, forward_fn=tied_head),
    ]


def join_layers():
    """Built modules, as the example's join_layers(AlexNet): by parameter count, stage 2 starts at the ReLU."""
    torch.manual_seed(SEED)
    return [nn.Linear(8, 64), nn.Linear(64, 8), nn.ReLU(inplace=True), nn.Linear(8, 64, bias=False),
            lambda x: torch.flatten(x, 1), nn.Linear(64, 8)]


def main_pipeline(rank, trainset, ds_config: dict, steps: int, num_stages: int, built: bool = False):
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.runtime.utils.set_random_seed(SEED)
    net = PipelineModule(layers=join_layers() if built else pipe_layers(), loss_fn=torch.nn.MSELoss(),
                         num_stages=num_stages, partition_method="parameters" if built else "uniform")
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=trainset,
        config=ds_config)
    losses = [engine.train_batch().item() for _ in range(steps)]
    held_out = engine.eval_batch(RepeatingLoader([trainset[:4]]))
    return losses, float(held_out), {k: v.float() for k, v in engine.consolidated_state_dict().items()}


# -- DeepSpeed's Getting Started / ZeRO-3 idioms ---------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)
        self.apply(self._init_weights)       # the parent re-initialises its children (nanoGPT / HF style)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.3)
            nn.init.zeros_(module.bias)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def main_zero3(rank, data, ds_config: dict, save_dir: str):
    set_random_seed(SEED + rank)     # each rank draws different numbers: rank 0's are kept
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = MLP()
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                              config=ds_config)
    x, y = data
    per_rank = x.shape[1] // engine.world_size
    losses, lrs = [], []
    for step in range(6):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = F.mse_loss(engine(x[step][rows]), y[step][rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append(lr_scheduler.get_lr()[0])
        if engine.global_steps == 3:
            engine.save_checkpoint(save_dir, tag=loss.item(), client_state={"step": step})
    _, client_state = engine.load_checkpoint(save_dir)
    state_at_load = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    with deepspeed.zero.GatheredParameters(engine.module.fc2.bias, modifier_rank=0):
        if engine.global_rank == 0:
            engine.module.fc2.bias.data.fill_(0.25)
    engine.save_16bit_model(save_dir, "model.safetensors")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        bias = engine.module.fc2.bias.detach().clone()
    return {"losses": losses, "lrs": lrs, "client_state": client_state, "state_at_load": state_at_load,
            "steps_at_load": engine.global_steps, "bias": bias, "stage": engine.zero_optimization_stage()}


# -- a client optimizer and scheduler, parameter groups, no_sync ----------------------------------------
def main_client(rank, data, ds_config: dict):
    set_random_seed(SEED)
    model = MLP()
    groups = [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
              {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0}]
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
        config=ds_config)
    x, y = data
    per_rank = x.shape[1] // engine.world_size
    losses = []
    for step in range(x.shape[0]):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        half = per_rank // 2
        xs, ys = x[step][rows], y[step][rows]
        with engine.no_sync():
            first = F.mse_loss(engine(xs[:half]), ys[:half])
            engine.backward(first)
        second = F.mse_loss(engine(xs[half:]), ys[half:])
        engine.backward(second)
        engine.step()
        losses.append((first.item() + second.item()) / 2)
    assert math.isclose(engine.get_lr()[0], 0.2 / (1 + x.shape[0]))
    count = torch.ones(1)
    dist.all_reduce(count)
    dist.barrier()
    assert count.item() == dist.get_world_size() == engine.world_size and dist.get_rank() == rank
    return losses, {k: v.float() for k, v in engine.consolidated_state_dict().items()}


# -- a client optimizer and scheduler objects, saved and resumed ----------------------------------------
def main_client_resume(rank, data, ds_config: dict, save_dir: str, mode: str):
    """mode 'all': every step; 'save': 2 steps, saved; 'load': other weights, loaded, the remaining steps."""
    set_random_seed(SEED + (7 if mode == "load" else 0))
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    engine, _, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                      config=ds_config)
    if mode == "load":
        engine.load_checkpoint(save_dir)
    x, y = data
    per_rank = x.shape[1] // engine.world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for step in range(engine.global_steps, 2 if mode == "save" else x.shape[0]):
        loss = F.mse_loss(engine(x[step][rows]), y[step][rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if mode == "save":
        engine.save_checkpoint(save_dir)
    return losses, lr_scheduler.get_last_lr()
