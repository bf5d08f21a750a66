"""bunsan (分散, "distributed"): train and run large language models across many processes and GPUs."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from bunsan import models, pipeline, zero
from bunsan.comm.collectives import Comm, CommError
from bunsan.config.root import Config, ConfigError
from bunsan.comm.mesh import Mesh
from bunsan.comm.process_group import backend_name, collective_timeout, init_distributed
from bunsan.engine.engine import Engine
from bunsan.tensor_parallel import TPContext, apply_tensor_parallel
from bunsan.transforms.checkpointing import apply_activation_checkpointing
from bunsan.transforms.compile import apply_compile
from bunsan.estimator import estimate
from bunsan.planner.search import plan

__version__ = "0.1.0"
__all__ = ["initialize", "init_distributed", "Config", "ConfigError", "Engine", "Mesh", "CommError", "models", "zero",
           "estimate", "plan"]


def initialize(model: nn.Module | None = None, config=None, optimizer: torch.optim.Optimizer | None = None,
               loss_fn=None, tp_plan: dict | None = None, **deepspeed_kwargs) -> Engine:
    """Wrap a plain model for distributed training; `config` is a dict, a file path or a Config.

    Works whether torch.distributed was initialised by the user, by torchrun's environment,
    or not at all (then this process is a world of one). DeepSpeed's keyword form
    `initialize(model=..., optimizer=..., config=...)` is accepted; so are its
    `model_parameters` (ignored: bunsan trains the parameters with requires_grad) and
    `config_params` (an alias of config). `tp_plan` maps module paths to tensor-parallel
    styles for a model other than bunsan's Llama (see bunsan.tensor_parallel.plan).
    """
    if model is None:
        raise TypeError("bunsan.initialize needs a model: initialize(model, config)")
    if config is None:
        config = deepspeed_kwargs.pop("config_params", None)
    deepspeed_kwargs.pop("model_parameters", None)
    if deepspeed_kwargs:
        raise TypeError(f"bunsan.initialize got unexpected arguments {sorted(deepspeed_kwargs)}; it takes "
                        "model, config, optimizer, loss_fn, tp_plan")
    cfg = Config.load(config)
    missing = cfg.unimplemented()
    if missing:
        raise ConfigError("\n".join(missing))
    device = init_distributed(cfg.train.backend, timeout_s=cfg.train.timeout_s)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    mesh = Mesh.create(pp=cfg.pipeline.stages, tp=cfg.tensor_parallel.size)
    comm = Comm(timeout_s=collective_timeout(cfg.train.timeout_s, backend_name()),
                gloo_collectives=cfg.train.gloo_collectives, device=device)
    pipe = None
    if cfg.lora.enabled:   # against the whole model, before a pipeline keeps this rank's part of it
        from bunsan.transforms.lora import check_targets
        check_targets(model, cfg.lora)
    if mesh.pp > 1:   # keep (and build) only this rank's stages; the rest of the model is never allocated
        pipe = pipeline.setup(model, mesh, cfg, device, cfg.train.seed)
        model = pipe.stage
        if optimizer is not None:   # the user's optimizer was built over the whole model: keep this stage's
            held = {id(p) for p in model.parameters()}
            for g in optimizer.param_groups:
                g["params"] = [p for p in g["params"] if id(p) in held]
    if cfg.lora.enabled:   # before the engine: only the adapters are trainable, so only they get grads and states
        from bunsan.transforms.lora import adapter_aware, apply_lora
        apply_lora(model, cfg.lora, cfg.train.seed, check=False)
        if callable(getattr(model, "init_parameter", None)):   # a meta model is drawn later, adapters included
            model.init_parameter = adapter_aware(model.init_parameter)
        if optimizer is not None:
            raise ValueError("lora.enabled with an optimizer passed in: the adapters are made after it, so let "
                             "bunsan build the optimizer from the config's optimizer section")
    meta = any(p.is_meta for p in model.parameters())
    if meta and (cfg.zero_optimization.stage < 3 or mesh.tp > 1):
        _materialize(model, device, cfg.train.seed)   # stage 3 alone materialises each rank's shard only
    tp = None
    if mesh.tp > 1:   # torchtitan's order: tensor parallel -> activation checkpointing -> compile -> data parallel
        ctx = TPContext(comm, mesh.tp_group, cfg.tensor_parallel.sequence_parallel)
        names = {p: n for n, p in model.named_parameters()}
        tp = (ctx, apply_tensor_parallel(model, ctx, tp_plan))
        if optimizer is not None:   # the layers were swapped: point the user's groups at the shards, by name
            shards = dict(model.named_parameters())
            for g in optimizer.param_groups:
                g["params"] = [shards[names[p]] for p in g["params"]]
    if cfg.activation_checkpointing.enabled and not (pipe is not None and not hasattr(model, "layers")):
        apply_activation_checkpointing(model)      # (a pipeline stage may hold no blocks: nothing to recompute)
    if cfg.train.compile:
        apply_compile(model)
    return Engine(model, cfg, mesh, device, comm, optimizer=optimizer, loss_fn=loss_fn, tp=tp, pipe=pipe)


def _materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a model built on the meta device and initialise it with its own init_weights."""
    init = getattr(model, "init_weights", None)
    if init is None:
        raise ValueError(f"{type(model).__name__} was built on the meta device but has no init_weights(); "
                         "build it on a real device or give it an init_weights method")
    model.to_empty(device=device)
    torch.manual_seed(seed)
    if "seed" in inspect.signature(init).parameters:  # same weights on any device and any stage
        init(seed=seed)
    else:
        init()
