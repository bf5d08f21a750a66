"""`initialize`: a plain model becomes a training engine through transforms applied in one visible order,

    (tensor-parallel plan) -> pipeline cut -> LoRA -> materialise -> saving forms -> tensor parallel ->
    context parallel -> expert parallel -> activation checkpointing (full or selective) and offload -> compile
    -> data parallel (the ZeRO strategy; the experts' over their own group) -> Engine

torchtitan's order. Each transform below is a function with one job; the model code never learns about
any of them (parameter names and state-dict keys stay those of the plain model).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from bunsan import pipeline
from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from bunsan.comm.process_group import backend_name, collective_timeout, init_distributed
from bunsan.config.deepspeed_keys import warn_ignored
from bunsan.config.errors import ConfigError
from bunsan.config.root import Config
from bunsan.context_parallel import CPContext, apply_context_parallel
from bunsan.engine.engine import Engine
from bunsan.engine.precision import model_dtype
from bunsan.expert_parallel import (EPContext, apply_expert_parallel, check_has_experts, expert_parameter_names,
                                    expert_unit_classes)
from bunsan.models.blocks import repeated_blocks
from bunsan.models.llama import Llama
from bunsan.optim.optimizers import optimizer_class, rebuild_over, restricted_to
from bunsan.optim.stepping import check_where, refuse_stepped
from bunsan.tensor_parallel import TPContext, apply_tensor_parallel, replicated_parameter_names
from bunsan.tensor_parallel.hf_plan import is_hf_model
from bunsan.tensor_parallel.plan import check_plan_matches, resolve_plan
from bunsan.transforms.checkpointing import apply_activation_checkpointing
from bunsan.transforms.compile import apply_compile
from bunsan.transforms.lora import adapter_aware, apply_lora, check_targets
from bunsan.transforms.offload import apply_activation_offload
from bunsan.transforms.saving_forms import apply_saving_forms
from bunsan.transforms.selective import apply_selective_recompute
from bunsan.zero import OtherDims, make_strategy
from bunsan.zero.experts import ExpertSplit


@dataclass
class Placement:
    """Where this rank runs and with whom: chosen once, before any transform."""
    cfg: Config
    device: torch.device
    mesh: Mesh
    comm: Comm


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
    at = place(load_config(config, deepspeed_kwargs))
    if at.cfg.data_efficiency.curriculum():
        raise ValueError("data_efficiency's curriculum learning acts on the training loader that "
                         "bunsan.deepspeed.initialize(training_data=...) makes (DeepSpeed's meaning); bunsan.initialize "
                         "and `bunsan train` have no such loader: set data_efficiency.enabled false, or call "
                         "bunsan.deepspeed.initialize with training_data")
    user_groups = optimizer_groups_by_name(optimizer, model, at.cfg)
    tp_plan = whole_model_plan(model, at, tp_plan)
    check_context_parallel(model, at)
    if at.mesh.ep > 1:
        check_has_experts(model, at.mesh.ep)
    model, pipe = cut_pipeline(model, at)
    add_lora(model, at.cfg)
    materialize(model, at)
    if at.cfg.train.saving_forms:     # a transformers model's norms and MLPs save what bunsan's Llama saves
        apply_saving_forms(model)
    model, tp = tensor_parallel(model, at, tp_plan, pipe)
    cp = context_parallel(model, at)
    ep = expert_parallel(model, at)
    recompute(model, at.cfg, pipe)
    if at.cfg.train.compile:
        apply_compile(model)
    optimizer = follow_user_optimizer(optimizer, user_groups, model)
    strategy = data_parallel(model, at, optimizer, tp, pipe, ep)
    return Engine(model, at.cfg, at.mesh, at.device, at.comm, strategy, loss_fn=loss_fn, tp=tp, pipe=pipe, cp=cp,
                  ep=ep)


NO_TENSORBOARD = ("an engine you step yourself writes no TensorBoard scalars (`bunsan train` writes its metric "
                  "records there); log engine.lr and your losses with your own SummaryWriter")


def load_config(config, deepspeed_kwargs: dict) -> Config:
    if config is None:
        config = deepspeed_kwargs.pop("config_params", None)
    deepspeed_kwargs.pop("model_parameters", None)
    if deepspeed_kwargs:
        raise TypeError(f"bunsan.initialize got unexpected arguments {sorted(deepspeed_kwargs)}; it takes "
                        "model, config, optimizer, loss_fn, tp_plan")
    cfg = Config.load(config)
    if cfg.tensorboard.enabled:   # only `bunsan train` writes its metric records as TensorBoard scalars
        warn_ignored("tensorboard.enabled", True, NO_TENSORBOARD)
    missing = cfg.unimplemented()
    if missing:
        raise ConfigError("\n".join(missing))
    return cfg


def place(cfg: Config) -> Placement:
    """The process group, this rank's device and the (pp, dp, cp, tp) mesh."""
    device = init_distributed(cfg.train.backend, timeout_s=cfg.train.timeout_s)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    mesh = Mesh.create(pp=cfg.pipeline.stages, tp=cfg.tensor_parallel.size, cp=cfg.context_parallel.size,
                       ep=cfg.expert_parallel.size)
    comm = Comm(timeout_s=collective_timeout(cfg.train.timeout_s, backend_name()),
                gloo_collectives=cfg.train.gloo_collectives, device=device)
    return Placement(cfg, device, mesh, comm)


def optimizer_groups_by_name(optimizer, model: nn.Module, cfg: Config) -> list[list[list[str]]] | None:
    """The user's optimizer groups as parameter names (every alias of a tied weight): the transforms replace
    and drop parameters, and names are what survive them."""
    if optimizer is None:
        return None
    refuse_stepped(optimizer)
    if cfg.lora.enabled:
        raise ValueError("lora.enabled with an optimizer passed in: the adapters are made after it, so let "
                         "bunsan build the optimizer from the config's optimizer section")
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return [[aliases[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def follow_user_optimizer(optimizer, groups_by_name, model: nn.Module):
    """Point the user's optimizer groups at this rank's parameters (a pipeline keeps a stage's; tensor
    parallelism swaps layers for shards); a weight this rank does not hold leaves its group."""
    if optimizer is None:
        return None
    held = dict(model.named_parameters(remove_duplicate=False))
    for g, names in zip(optimizer.param_groups, groups_by_name):
        params = [next(held[n] for n in alias if n in held) for alias in names if any(n in held for n in alias)]
        # a frozen parameter gets no gradient, so torch's step skips it: it leaves the group
        g["params"] = list({id(p): p for p in params if p.requires_grad}.values())
    if any(optimizer.state.values()):
        # a fresh optimizer's only state is what its constructor made (Adagrad's step 0 and initial sums), for
        # tensors the transforms may have replaced: built again, it makes that state for the tensors it now holds
        return rebuild_over(optimizer, {p: p for g in optimizer.param_groups for p in g["params"]})
    return optimizer


def cut_pipeline(model: nn.Module, at: Placement):
    """Keep (and build) only this rank's stages; the rest of the model is never allocated."""
    if at.cfg.lora.enabled:   # against the whole model, before a stage keeps part of it
        check_targets(model, at.cfg.lora)
    if at.mesh.pp == 1:
        return model, None
    pipe = pipeline.setup(model, at.mesh, at.cfg, at.device, at.cfg.train.seed)
    return pipe.stage, pipe


def add_lora(model: nn.Module, cfg: Config) -> None:
    """Before the engine: only the adapters are trainable, so only they get gradients and optimizer states."""
    if not cfg.lora.enabled:
        return
    apply_lora(model, cfg.lora, cfg.train.seed, check=False)
    if callable(getattr(model, "init_parameter", None)):   # a meta model is drawn later, adapters included
        model.init_parameter = adapter_aware(model.init_parameter)


def materialize(model: nn.Module, at: Placement) -> None:
    """Allocate a model built on the meta device and initialise it with its own init_weights; ZeRO-3 without
    tensor parallelism instead materialises each rank's shard only, unit by unit (zero/stage3.py)."""
    if not any(p.is_meta for p in model.parameters()):
        return
    if at.cfg.zero_optimization.stage == 3 and at.mesh.tp == 1 and at.mesh.ep == 1:
        return      # (under TP or EP the whole weights are drawn first, then each rank keeps its slice)
    init = getattr(model, "init_weights", None)
    if init is None:
        raise ValueError(f"{type(model).__name__} was built on the meta device but has no init_weights(); "
                         "build it on a real device or give it an init_weights method")
    model.to_empty(device=at.device)
    seed = at.cfg.train.seed
    torch.manual_seed(seed)
    if "seed" in inspect.signature(init).parameters:  # same weights on any device and any stage
        init(seed=seed)
    else:
        init()


def tp_context(at: Placement) -> TPContext:
    tp = at.cfg.tensor_parallel
    return TPContext(at.comm, at.mesh.tp_group, tp.sequence_parallel, tp.encoders)


def whole_model_plan(model: nn.Module, at: Placement, tp_plan: dict | str | None):
    """The tensor-parallel plan, resolved (a Hugging Face model's own, or the Llama one) and checked against
    the whole model, before a pipeline keeps a stage of it."""
    if at.mesh.tp == 1:
        return tp_plan
    if at.mesh.pp > 1 and at.cfg.tensor_parallel.sequence_parallel and is_hf_model(model):
        raise ValueError("pipeline parallelism with sequence parallelism of a Hugging Face model is not supported: "
                         "a later stage would build its mask and positions from a slice of the sequence; set "
                         "tensor_parallel.sequence_parallel to false or pipeline.stages to 1")
    plan = resolve_plan(model, tp_context(at), tp_plan)
    check_plan_matches(model, plan)
    return plan


def tensor_parallel(model: nn.Module, at: Placement, tp_plan: dict | None, pipe):
    """Swap layers for their Megatron column/row/vocab-parallel forms; (TPContext, vocab head) or None."""
    if at.mesh.tp == 1:
        return model, None
    ctx = tp_context(at)
    return model, (ctx, apply_tensor_parallel(model, ctx, tp_plan, stage_only=True))


def check_context_parallel(model: nn.Module, at: Placement) -> None:
    """Context parallelism replaces bunsan's Llama attention; any other model is refused before any work."""
    if at.mesh.cp == 1:
        return
    if not isinstance(model, Llama):
        raise ValueError(f"context_parallel.size {at.mesh.cp} with a {type(model).__name__}: context parallelism "
                         "splits attention of bunsan's own Llama (bunsan.models.llama.Llama) only; a Hugging Face "
                         "or other model would attend to its own share of the tokens alone. Set "
                         "context_parallel.size to 1, or train a bunsan Llama (bunsan.models.hf loads HF weights)")


def context_parallel(model: nn.Module, at: Placement) -> CPContext | None:
    """Each Attention all-gathers K/V over the context-parallel group (a pipeline stage: its own blocks')."""
    if at.mesh.cp == 1:
        return None
    ctx = CPContext(at.comm, at.mesh.cp_group, model.config)
    apply_context_parallel(model, ctx)
    return ctx


def expert_parallel(model: nn.Module, at: Placement) -> EPContext | None:
    """Each MoE block keeps its share of the experts and reaches the rest by all-to-all over the mesh's
    expert-parallel group (a pipeline stage: its own blocks'; a stage of dense layers only has none to split, and
    trains as data parallelism)."""
    if at.mesh.ep == 1:
        return None
    ctx = EPContext(at.comm, at.mesh.ep_group, at.mesh.edp_group, at.mesh.tp_group if at.mesh.tp > 1 else None)
    return ctx if apply_expert_parallel(model, ctx) else None


def recompute(model: nn.Module, cfg: Config, pipe) -> None:
    """Activation checkpointing of every block (full or selective), then the offload of the chosen blocks'
    saved activations to host memory, around the checkpoint; a pipeline stage of only the embedding or head
    has no blocks."""
    ac = cfg.activation_checkpointing
    mode, offloaded = ac.recompute_mode, ac.offloaded
    if (mode == "none" and not offloaded) or (pipe is not None and not repeated_blocks(model)):
        return
    if mode == "full":
        apply_activation_checkpointing(model)
    elif mode == "selective":
        apply_selective_recompute(model, ac.recompute_ops)
    if offloaded:
        apply_activation_offload(model, offloaded)


def data_parallel(model: nn.Module, at: Placement, optimizer, tp, pipe, ep=None):
    """The model in its training dtype on the device, and the ZeRO strategy that owns its gradients, master
    weights and optimizer states."""
    cfg, mesh = at.cfg, at.mesh
    check_where(type(optimizer) if optimizer is not None else optimizer_class(cfg.optimizer.type),
                cfg.zero_optimization.stage, tp is not None)
    dtype = model_dtype(cfg)
    if dtype != torch.float32 and optimizer is not None and \
            any(p.dtype != torch.float32 for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("with fp16/bf16 bunsan keeps fp32 master weights itself: build the optimizer over "
                         "the fp32 model and let bunsan cast the model")
    if any(p.is_meta for p in model.parameters()):   # bunsan.zero.Init: ZeRO-3 materialises shards
        model.to(dtype=dtype)
    else:
        model.to(device=at.device, dtype=dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        if cfg.lora.enabled:
            raise ValueError(f"rank {mesh.rank} holds no layer named in lora.target_modules "
                             f"{list(cfg.lora.target_modules)} (a pipeline stage of only the embedding or "
                             "head?): target more modules, or use fewer pipeline stages")
        raise ValueError("the model has no parameters with requires_grad=True; nothing to train")
    dims = other_dims(model, mesh, tp, pipe)
    if ep is not None:
        return expert_split(model, at, optimizer, trainable, dims)
    # context-parallel ranks hold the same weights and different tokens: data parallel for gradients
    return make_strategy(trainable, at.comm, mesh.grad_group, cfg, at.device, optimizer, model, dims)


def expert_split(model: nn.Module, at: Placement, optimizer, trainable: list, dims: OtherDims) -> ExpertSplit:
    """The dense weights' strategy over the gradient group and the experts' over the expert-data-parallel
    group (zero/experts.py), each with its share of the user's optimizer."""
    names = expert_parameter_names(model)
    expert_ids = {id(p) for n, p in model.named_parameters() if n in names}
    experts = [p for p in trainable if id(p) in expert_ids]
    dense = [p for p in trainable if id(p) not in expert_ids]
    if not experts or not dense:
        raise ValueError(f"expert parallelism needs trainable experts and trainable dense weights; this rank "
                         f"trains {len(experts)} expert and {len(dense)} other tensors (frozen experts, or LoRA "
                         "on the attention only?): set expert_parallel.enabled false")
    mesh, cfg = at.mesh, at.cfg
    # ZeRO-3: the experts' strategy gathers each experts module as a unit of its own, inside the dense
    # strategy's gather of the block around it
    expert_cfg = cfg.override({"zero_optimization.stage3_unit_modules": expert_unit_classes(model)}) \
        if cfg.zero_optimization.stage == 3 else cfg
    # (each part's norm without the pipeline's sum, which the split adds once: zero/experts.py)
    within = dataclasses.replace(dims, pp_group=None)
    parts = [make_strategy(ps, at.comm, group, c, at.device, restricted_to(optimizer, ps), model, within)
             for ps, group, c in ((dense, mesh.grad_group, cfg), (experts, mesh.edp_group, expert_cfg))]
    # which of the user's groups each part's groups come from (a group with no member there is left out)
    user = optimizer.param_groups if optimizer is not None else [{"params": trainable}]
    held = [{id(p) for p in ps} for ps in (dense, experts)]
    sources = tuple([i for i, g in enumerate(user) if any(id(p) in ids for p in g["params"])] for ids in held)
    return ExpertSplit(*parts, at.comm, mesh.ep_group, sources, len(user), dims.pp_group)


def other_dims(model: nn.Module, mesh: Mesh, tp, pipe) -> OtherDims:
    """The tensor- and pipeline-parallel facts the data-parallel strategy's gradient norm needs."""
    elsewhere = set(pipe.duplicates) if pipe is not None else set()
    if tp is not None and mesh.tp_rank != 0:
        elsewhere |= replicated_parameter_names(model)
    return OtherDims(tp_group=mesh.tp_group if tp is not None else None,
                     pp_group=mesh.pp_group if pipe is not None else None,
                     counted_elsewhere=frozenset(elsewhere))
