"""`deepspeed.initialize` and `deepspeed.init_distributed` in DeepSpeed's form, over `bunsan.initialize`.

    engine, optimizer, training_dataloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=params, training_data=trainset, config=ds_config)

The config comes from `config` / `config_params` or `args.deepspeed_config` (one of them, as in DeepSpeed).
`model_parameters` says what the configured optimizer trains (parameters or parameter groups with their
own hyperparameters); `optimizer` and `lr_scheduler` may be objects or callables, as DeepSpeed takes them.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler

import bunsan
from bunsan.comm import functional as world
from bunsan.config.files import read_config_file
from bunsan.config.root import Config
from bunsan.deepspeed.curriculum import Curriculum, CurriculumLoader
from bunsan.deepspeed.engine import DeepSpeedEngine, PipelineEngine
from bunsan.deepspeed.moe.layer import MoE
from bunsan.deepspeed.pipe import PipelineModule
from bunsan.deepspeed.schedulers import ClientScheduler, ConfiguredScheduler
from bunsan.deepspeed.zero import slice_of
from bunsan.optim.optimizers import build_optimizer

log = logging.getLogger("bunsan.deepspeed")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1):
    """The process group from torchrun's (or DeepSpeed's launcher's) environment; a world of one without one."""
    if init_method is not None or rank != -1 or world_size != -1:
        raise ValueError("init_distributed(init_method=/rank=/world_size=): bunsan reads the launcher's "
                         "environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); launch with torchrun or "
                         "`bunsan launch` and drop the arguments")
    if dist_backend not in (None, "nccl", "gloo"):
        raise ValueError(f"dist_backend {dist_backend!r}: bunsan runs on 'nccl' (NVIDIA GPUs) or 'gloo' (CPU)")
    return bunsan.init_distributed(dist_backend, timeout_s=timeout.total_seconds() if timeout else None)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: --deepspeed, --deepspeed_config (and the older --deepscale ones)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (bunsan)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args, config, config_params):
    if config is not None and config_params is not None:
        raise ValueError("initialize got both config and config_params; pass one")
    given = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if given is not None and from_args is not None:
        raise ValueError(f"the DeepSpeed config was given twice: args.deepspeed_config={from_args!r} and "
                         "initialize(config=...); pass one of them (DeepSpeed refuses this too)")
    if given is None and from_args is None:
        raise ValueError("deepspeed.initialize needs a config: config=dict-or-path, or args.deepspeed_config")
    return given if given is not None else from_args


def _as_dict(source) -> dict:
    """The DeepSpeed config as the script gave it (a dict, or the file read): what DeepSpeed's engine.config
    holds, and transformers reads (engine.config["zero_optimization"])."""
    if isinstance(source, Config):
        return source.to_dict()
    return dict(source) if isinstance(source, dict) else read_config_file(source)


def _check_local_rank(args) -> None:
    arg = getattr(args, "local_rank", None)
    env = os.environ.get("LOCAL_RANK")
    if arg is not None and arg >= 0 and env is not None and int(env) != arg:
        raise ValueError(f"args.local_rank={arg} but the launcher set LOCAL_RANK={env}; drop --local_rank or "
                         "pass the launcher's value")


def _pipeline_config(cfg: Config, model: PipelineModule) -> Config:
    """A PipelineModule brings its stage count and partition method into the config."""
    if cfg.pipeline.stages not in (1, model.num_stages):
        raise ValueError(f"PipelineModule(num_stages={model.num_stages}) but the config says pipeline.stages="
                         f"{cfg.pipeline.stages}; drop the config key (the module's count is used)")
    return cfg.override({"pipeline.stages": model.num_stages, "pipeline.partition": model.partition_method})


def _expert_parallel_config(cfg: Config, model: nn.Module) -> Config:
    """DeepSpeed makes the expert-parallel groups its MoE layers ask for (their ep_size); bunsan's mesh folds
    one size, the layers' (expert_parallel.autoep_size, set here unless the config says another)."""
    sizes = sorted({m.ep_size for m in model.modules() if isinstance(m, MoE)})
    if not sizes or sizes == [1]:
        return cfg
    if len(sizes) > 1:
        raise ValueError(f"MoE layers with ep_size {sizes}: bunsan folds one expert-parallel size over the ranks; "
                         "give every MoE layer the same ep_size")
    said = cfg.expert_parallel.size
    if said not in (1, sizes[0]):
        raise ValueError(f"the MoE layers have ep_size {sizes[0]} but expert_parallel.autoep_size is {said}; "
                         "remove the expert_parallel section or make the two agree")
    return cfg.override({"expert_parallel.enabled": True, "expert_parallel.autoep_size": sizes[0]})


def _client_optimizer(optimizer, model_parameters, model: nn.Module, cfg: Config):
    """The optimizer bunsan.initialize gets: the client's (a callable is called on the parameters, as
    DeepSpeed does), or the configured one over `model_parameters` when those are not simply every trainable
    parameter (groups with their own hyperparameters, or a subset)."""
    params = None if model_parameters is None else list(model_parameters)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable(params), got "
                            f"{type(optimizer).__name__}")
        return optimizer(params if params is not None else model.parameters())
    if optimizer is not None or params is None:
        return optimizer
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if all(isinstance(p, torch.Tensor) for p in params) and {id(p) for p in params} == trainable:
        return None           # the configured optimizer over every trainable parameter: bunsan's default
    return build_optimizer(params, cfg.optimizer, torch.device("cpu"))


def _loader(dataset, collate_fn, engine, cfg: Config, curriculum: dict):
    """DeepSpeed's training loader: micro-batches of this data-parallel rank's share (DistributedSampler,
    shuffled with its seed 0, the same order every epoch unless the script calls set_epoch); with
    data_efficiency's curriculum, each batch also carries the curriculum's difficulties (curriculum.py)."""
    sampler = DistributedSampler(dataset, num_replicas=engine.mesh.dp, rank=engine.mesh.dp_rank)
    loader = DataLoader(dataset, batch_size=engine.micro_batch, sampler=sampler, collate_fn=collate_fn,
                        drop_last=cfg.dataloader_drop_last,
                        num_workers=cfg.data_efficiency.data_sampling.num_workers if curriculum else 0)
    return CurriculumLoader(loader, Curriculum(curriculum), engine.grad_accum) if curriculum else loader


def _scheduler(lr_scheduler, engine, cfg: Config, user_optimizer):
    if lr_scheduler is None:
        return ConfiguredScheduler(engine) if cfg.scheduler is not None else None
    if cfg.scheduler is not None:
        log.warning("both a client lr_scheduler and the config's scheduler %s: the client's is used, as in "
                    "DeepSpeed", cfg.scheduler.type)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        # DeepSpeed calls it with the torch optimizer under its ZeRO wrapper: the client's, else a stand-in
        # with the engine's groups (ZeRO 1-3 step shards with their own), whose lrs the engine then copies
        target = user_optimizer if user_optimizer is not None else engine.optimizer
        if not isinstance(target, torch.optim.Optimizer):
            target = torch.optim.SGD([{"params": [torch.zeros(0)], **{k: v for k, v in g.items() if k != "params"}}
                                      for g in engine.optimizer.param_groups], lr=0.0)
        return ClientScheduler(lr_scheduler(target), engine.optimizer)
    return ClientScheduler(lr_scheduler, engine.optimizer)


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = 29500, mpu=None, dist_init_required: bool | None = None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """(engine, optimizer, training_dataloader, lr_scheduler), as DeepSpeed returns them."""
    if model is None:
        raise ValueError("deepspeed.initialize needs model=")
    if mpu is not None or mesh_param is not None:
        raise ValueError("initialize(mpu=/mesh_param=): bunsan builds its own mesh; set tensor_parallel.size and "
                         "pipeline.stages (or use a PipelineModule) in the config instead")
    if dist_init_required is False and not world.is_initialized():
        raise ValueError("dist_init_required=False but torch.distributed is not initialised; initialise it "
                         "first or drop the argument")
    _check_local_rank(args)
    cfg = Config.load(_config_source(args, config, config_params))
    pipe = isinstance(model, PipelineModule)
    if pipe:
        cfg = _pipeline_config(cfg, model)
        if any(slice_of(p) is not None for p in model.parameters()):
            raise ValueError("a PipelineModule built under zero.Init: a pipeline builds only its own stage's "
                             "layers already (LayerSpec); build it without zero.Init")
    curriculum = cfg.data_efficiency.data_sampling.curriculum_learning.curriculum_metrics \
        if cfg.data_efficiency.curriculum() else {}
    if curriculum and training_data is None:
        raise ValueError(f"data_efficiency's curriculum ({', '.join(curriculum)}) acts on the loader initialize "
                         "makes from training_data, as in DeepSpeed; pass training_data=, or set "
                         "data_efficiency.enabled false")
    if curriculum:   # it acts here, on the loader; the engine has nothing to do with it
        cfg = cfg.override({"data_efficiency.enabled": False})
    cfg = _expert_parallel_config(cfg, model)
    client = _client_optimizer(optimizer, model_parameters, model, cfg)
    engine = bunsan.initialize(model, cfg, optimizer=client, loss_fn=model.loss_fn if pipe else None)
    loader = _loader(training_data, collate_fn, engine, cfg, curriculum) if training_data is not None else None
    scheduler = _scheduler(lr_scheduler, engine, cfg, client)
    facade = (PipelineEngine if pipe else DeepSpeedEngine)(engine, scheduler, loader)
    facade.config = _as_dict(_config_source(args, config, config_params))   # DeepSpeed's engine.config
    return facade, engine.optimizer, loader, scheduler
