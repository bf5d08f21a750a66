"""DeepSpeed's engine over bunsan's: the attributes and methods DeepSpeed scripts use, as an nn.Module (so
train/eval/parameters/state_dict behave as DeepSpeed's, whose engine is one too), and the pipeline engine's
`train_batch(data_iter)`.

Everything that trains is bunsan's Engine (`engine.bunsan`); this file only translates names and calling
conventions. An attribute this class does not define is looked up on the bunsan engine, then on the model (as
DeepSpeed's engine does: `engine.config`, `engine.gradient_checkpointing_enable()` reach a transformers model).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import weakref
from pathlib import Path

import torch
import torch.nn as nn

from bunsan.checkpoint.store import candidates
from bunsan.deepspeed.schedulers import ClientScheduler
from bunsan.deepspeed.timer import ThroughputTimer
from bunsan.deepspeed.zero_status import tag_parameters
from bunsan.engine.engine import Engine

log = logging.getLogger("bunsan.deepspeed")

_LIVE: weakref.WeakSet = weakref.WeakSet()
SCHEDULER_KEY = "bunsan.deepspeed.lr_scheduler"   # where a client scheduler's state rides in client_state
CURRICULUM_KEY = "bunsan.deepspeed.curriculum"     # and the data_efficiency curriculum's (DeepSpeed saves it too)


def engine_holding(p: torch.Tensor) -> Engine | None:
    """The bunsan engine whose model holds parameter `p` (GatheredParameters finds its engine this way)."""
    for facade in list(_LIVE):
        if any(q is p for q in facade.bunsan.module.parameters()):
            return facade.bunsan
    return None


class DeepSpeedEngine(nn.Module):
    """What `deepspeed.initialize` returns first. `lr_scheduler` is the scheduler the engine steps after every
    applied optimizer step (the config's, or the client's), `training_dataloader` the loader made from
    `training_data`."""

    def __init__(self, engine: Engine, lr_scheduler=None, training_dataloader=None):
        super().__init__()
        self.bunsan = engine
        self.module = engine.module
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.tput_timer = ThroughputTimer(engine.train_batch_size)
        # DeepSpeed's fp16 optimizers say whether their last step overflowed (and was skipped); scripts read
        # engine.optimizer.overflow (DeepSpeed-Chat's PPO loop, under fp16)
        engine.optimizer.overflow = False
        _LIVE.add(self)
        self._follow_scheduler()
        if engine.strategy.stage == 3:
            tag_parameters(engine.module)
        if engine.cfg.hybrid_engine.enabled and hasattr(engine.module, "generate"):
            # DeepSpeed's hybrid engine answers the model's own generate (DeepSpeed-Chat calls
            # actor.module.generate): the same call, on the training weights, gathered once per call
            self._model_generate = engine.module.generate
            engine.module.generate = self.generate

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            engine = self.__dict__.get("bunsan")
            for owner in (engine, getattr(engine, "module", None)):
                if owner is not None and hasattr(owner, name):
                    return getattr(owner, name)
            raise

    # -- ranks, sizes and switches ---------------------------------------------------------------
    local_rank = property(lambda self: int(os.environ.get("LOCAL_RANK", 0)))   # host: an environment variable
    global_rank = property(lambda self: self.bunsan.mesh.rank)
    world_size = property(lambda self: self.bunsan.mesh.world.size)
    dp_world_size = property(lambda self: self.bunsan.mesh.dp)
    mp_world_size = property(lambda self: self.bunsan.mesh.tp)
    device = property(lambda self: self.bunsan.device)
    optimizer = property(lambda self: self.bunsan.optimizer)
    global_steps = property(lambda self: self.bunsan.global_step)
    global_samples = property(lambda self: self.bunsan.global_step * self.bunsan.train_batch_size)
    skipped_steps = property(lambda self: self.bunsan.skipped_steps)
    micro_steps = property(lambda self: self.bunsan.global_step * self.bunsan.grad_accum + self.bunsan.micro_steps)

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.bunsan.micro_batch

    def train_batch_size(self) -> int:
        return self.bunsan.train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.bunsan.grad_accum

    def zero_optimization_stage(self) -> int:
        return self.bunsan.strategy.stage

    def fp16_enabled(self) -> bool:
        return self.bunsan.cfg.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.bunsan.cfg.bf16.enabled

    def gradient_clipping(self) -> float:
        return self.bunsan.cfg.gradient_clipping

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.bunsan.optimizer.param_groups]

    def get_global_grad_norm(self) -> float:
        return self.bunsan.last_grad_norm

    def was_step_applied(self) -> bool:
        return self._applied

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.bunsan.is_gradient_accumulation_boundary()

    # -- the DeepSpeed-style loop ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.bunsan(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        if retain_graph:
            raise ValueError("backward(retain_graph=True) is not supported: bunsan's gradient hooks reduce and "
                             "free each gradient as backward produces it")
        self._check_states("backward")
        self.bunsan.backward(loss, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        if lr_kwargs:
            raise ValueError(f"step(lr_kwargs={lr_kwargs}): bunsan's schedules take no per-step arguments")
        self._check_states("step")
        self._after(self.bunsan.step)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """accelerate says before each backward whether it ends a step (and calls step() only when it does), as
        DeepSpeed takes it: that micro-batch ends the step, whatever the count, an epoch's shorter last
        accumulation included."""
        self.bunsan.set_gradient_accumulation_boundary(bool(is_boundary))

    def no_sync(self):
        return self.bunsan.no_sync()

    def zero_grad(self) -> None:
        """Drop the gradients of the micro-batches so far (DeepSpeed's engine.zero_grad)."""
        if self.bunsan.accumulated:
            raise RuntimeError(f"zero_grad() after {self.bunsan.accumulated} micro-batches of an accumulating "
                               "step: their gradients would be dropped while the step still counts them")
        self.bunsan.strategy.zero_grad()

    def _after(self, run):
        """Run a step (or a micro-batch of one); when an optimizer step was applied, step the scheduler."""
        step, skipped = self.bunsan.global_step, self.bunsan.skipped_steps
        self.tput_timer.start()
        out = run()
        stepped = self.bunsan.global_step > step
        self.tput_timer.stop(global_step=stepped)
        self._applied = stepped and self.bunsan.skipped_steps == skipped
        if stepped:
            self.bunsan.optimizer.overflow = not self._applied
        if self._applied and isinstance(self.lr_scheduler, ClientScheduler):
            self.lr_scheduler.step()
            self._follow_scheduler()
        return out

    _applied = False

    def _follow_scheduler(self) -> None:
        """A client scheduler sets lrs in its own optimizer's groups; the step uses the engine's."""
        if isinstance(self.lr_scheduler, ClientScheduler):
            self.lr_scheduler.copy_lrs(self.bunsan.optimizer)

    # -- data_efficiency's curriculum (curriculum.py) ---------------------------------------------------
    def _curriculum(self):
        loader = self.training_dataloader
        if not hasattr(loader, "curriculum"):
            raise RuntimeError("no curriculum: data_efficiency.data_sampling.curriculum_learning acts on the loader "
                               "deepspeed.initialize makes from training_data; enable it in the config and pass "
                               "training_data")
        return loader

    def set_data_post_process_func(self, post_process_func) -> None:
        """fn(batch, sampler_state) applied to every batch of the training loader (DeepSpeed's call)."""
        self._curriculum().post_process_func = post_process_func

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict) -> None:
        """{metric: fn(curriculum_step) -> difficulty} for metrics whose schedule_type is custom."""
        self._curriculum().curriculum.custom.update(schedule_func_dict)

    # -- the hybrid engine: generation on the training weights --------------------------------------
    def generate(self, *args, **kwargs):
        """The model's generate on the weights being trained: under ZeRO-3 every parameter is gathered once
        for the whole call (not one block per token) and released after; the model's mode is kept."""
        model_generate = self.__dict__.get("_model_generate") or type(self.module).generate.__get__(self.module)
        whole = self.bunsan.gathered_parameters() if self.bunsan.strategy.stage == 3 else contextlib.nullcontext()
        with torch.no_grad(), whole:
            return model_generate(*args, **kwargs)

    # -- device memory ---------------------------------------------------------------------------
    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """DeepSpeed's: the optimizer states, master weights, weights and gradients (`include`: some kinds of
        OffloadStateTypeEnum) moved to host memory until reload_states() (zero/park.py). The model refuses to
        run meanwhile. On the CPU the states are in host memory already: nothing moves."""
        device = getattr(device, "value", device)
        if device == "none":
            log.warning("offload_states(device='none'): nothing to offload to")
            return
        if device != "cpu":
            raise ValueError(f"offload_states(device={device!r}): DeepSpeed offloads to 'cpu' only; pass "
                             "OffloadDeviceEnum.cpu")
        if self._parked is not None:
            raise RuntimeError("offload_states() twice: the states are offloaded already; call reload_states()")
        from bunsan.zero.park import Parked, park
        at = self.bunsan.device
        self._parked = park(self.bunsan.strategy, include, at, pin_memory, non_blocking) if at.type != "cpu" \
            else Parked(at)
        self._park_guard = self.module.register_forward_pre_hook(_refuse_parked, prepend=True)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Undo offload_states()."""
        if self._parked is None:
            return
        self._parked.reload(non_blocking)
        self._park_guard.remove()
        self._parked = self._park_guard = None

    _parked = _park_guard = None

    def _check_states(self, what: str) -> None:
        if self._parked is not None:
            raise RuntimeError(f"{what} while the states are offloaded (offload_states()): call reload_states() "
                               "first")

    # -- saving ----------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        self._check_states("save_checkpoint")
        if not save_latest:
            raise ValueError("save_checkpoint(save_latest=False): bunsan always records the newest complete tag "
                             "(load picks it); drop the argument and load a tag by name")
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is not supported: bunsan's "
                             "checkpoints hold the whole model so that any layout can load them")
        state = dict(client_state or {})
        if isinstance(self.lr_scheduler, ClientScheduler):
            state[SCHEDULER_KEY] = self.lr_scheduler.state_dict()
        if hasattr(self.training_dataloader, "curriculum"):
            state[CURRICULUM_KEY] = self.training_dataloader.curriculum.state_dict()
        self.bunsan.save_checkpoint(save_dir, tag, state)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """(path, client_state); (None, None) with a warning when `load_dir` holds no checkpoint, as DeepSpeed."""
        if not load_module_strict or custom_load_fn is not None:
            raise ValueError("load_checkpoint(load_module_strict=False / custom_load_fn): bunsan loads every "
                             "tensor of the checkpoint, checked against the model; drop the argument")
        if tag is None and not candidates(Path(load_dir), None):
            log.warning("no checkpoint in %s; nothing loaded (DeepSpeed's answer: None, None)", load_dir)
            return None, None
        path, client_state = self.bunsan.load_checkpoint(
            load_dir, None if tag is None else str(tag), load_optimizer_states and not load_module_only)
        sched = client_state.pop(SCHEDULER_KEY, None)
        if sched is not None and load_lr_scheduler_states and isinstance(self.lr_scheduler, ClientScheduler):
            self.lr_scheduler.load_state_dict(sched)
            self._follow_scheduler()
        curriculum = client_state.pop(CURRICULUM_KEY, None)
        if curriculum is not None and hasattr(self.training_dataloader, "curriculum"):
            self.training_dataloader.curriculum.load_state_dict(curriculum)
        return str(path), client_state

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: bunsan gathers the whole weights whenever it saves a model, at every stage (the config's
        stage3_gather_16bit_weights_on_model_save is accepted and ignored), so transformers' Trainer saves
        them under ZeRO-3 too."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The whole model's state dict in its training dtype, on every rank (a collective under ZeRO-3)."""
        with self.bunsan.gathered_parameters():
            state = {n: t.detach().clone() for n, t in self.module.state_dict().items()}
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {n: t for n, t in state.items() if n not in frozen}
        return state

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The whole model, gathered, in its training dtype, written by rank 0 as safetensors (bunsan never
        writes pickles: a '.bin' name is saved as '.safetensors' beside it, with a warning)."""
        from bunsan.deepspeed.save import save_model
        if exclude_frozen_parameters:
            raise ValueError("save_16bit_model(exclude_frozen_parameters=True) is not supported; drop it")
        save_model(self.bunsan, save_dir, save_filename)
        return True


def _refuse_parked(module, args):
    raise RuntimeError(f"{type(module).__name__} ran while its engine's states are offloaded (offload_states()): "
                       "call reload_states() first")


def _stack(micro: list):
    """gradient_accumulation_steps micro-batches of (inputs, labels) as one batch, concatenated along rows."""
    first = micro[0]
    if isinstance(first, dict):
        return {k: torch.cat([mb[k] for mb in micro]) for k in first}
    if not isinstance(first, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in first):
        raise ValueError("a pipeline's data iterator yields (inputs, labels) pairs of tensors (or input_ids/labels "
                         f"dicts); got {type(first).__name__}" + (f" of {[type(t).__name__ for t in first]}"
                                                                  if isinstance(first, (tuple, list)) else ""))
    return tuple(torch.cat([mb[i] for mb in micro]) for i in range(len(first)))


class PipelineEngine(DeepSpeedEngine):
    """The engine of a PipelineModule: a whole step per call, micro-batches drawn from an iterator."""

    def __init__(self, engine: Engine, lr_scheduler=None, training_dataloader=None):
        super().__init__(engine, lr_scheduler, training_dataloader)
        self._data_iter = None
        if training_dataloader is not None:
            from bunsan.deepspeed.utils import RepeatingLoader
            self._data_iter = iter(RepeatingLoader(training_dataloader))

    num_stages = property(lambda self: self.bunsan.mesh.pp)
    stage_id = property(lambda self: self.bunsan.mesh.pp_rank)
    micro_batches = property(lambda self: self.bunsan.grad_accum)

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        self._data_iter = iterator

    def _draw(self, data_iter, n: int):
        it = data_iter if data_iter is not None else self._data_iter
        if it is None:
            raise ValueError("train_batch() without data_iter needs training_data passed to deepspeed.initialize "
                             "(or engine.set_dataiterator(it))")
        micro = list(itertools.islice(it, n))
        if len(micro) < n:
            raise ValueError(f"the data iterator ran out after {len(micro)} of the {n} micro-batches of a step; "
                             "wrap the loader in deepspeed.utils.RepeatingLoader")
        return _stack(micro)

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; their mean loss, on every rank."""
        batch = self._draw(data_iter, self.bunsan.grad_accum)
        loss = self._after(lambda: self.bunsan.train_batch(batch))
        return torch.tensor(loss, device="cpu")   # host: the loss the step already read with its norm

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        if return_logits or not compute_loss or reduce_output != "avg":
            raise ValueError("eval_batch: bunsan's pipeline returns the mean loss (reduce_output='avg', "
                             "compute_loss=True, return_logits=False); other forms are not supported")
        batch = self._draw(data_iter, num_micro_batches or self.bunsan.grad_accum)
        return torch.tensor(self.bunsan.eval_batch(batch), device="cpu")   # host: evaluation returns a number

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineEngine runs whole steps: call engine.train_batch(data_iter) and "
                           "engine.eval_batch(data_iter), as in DeepSpeed")

    backward = step = forward

