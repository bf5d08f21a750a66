"""The training engine: the step loop, loss scaling, clipping and the schedule around a data-parallel strategy.

One optimizer step = `gradient_accumulation_steps` micro-batches per data-parallel
rank. Two ways to drive it:

    loss = engine.train_batch(batch)          # the whole step; returns the global mean loss
    out = engine(x); engine.backward(loss); engine.step()   # DeepSpeed-style, once per micro-batch

Where gradients, master weights and optimizer states live is the strategy's
business (zero/strategy.py for ZeRO stage 0, zero/ for stages 1-3); tensor
parallelism has already swapped the model's layers when the engine is built.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from bunsan.doctor.oom import OutOfMemory, explain, is_oom
from bunsan.comm.rollcall import post_step
from bunsan.models.loss import lm_loss_sum
from bunsan.memory.measure import measured_memory, reset_peak_memory
from bunsan.optim.schedule import LRSchedule
from bunsan.pipeline import step as pipeline_step
from bunsan.pipeline.consolidate import gather_intervals, gather_stages
from bunsan.engine.precision import LossScaler, model_dtype
from bunsan.tensor_parallel import consolidate, vocab_parallel_loss_sum
from bunsan.zero import make_strategy


def _refuse_empty_batch(values: list[float]) -> None:
    if values[1] == 0:
        raise ValueError("every label in the global batch is -100; nothing to learn from")


class Engine:
    def __init__(self, model: nn.Module, cfg, mesh: Mesh, device: torch.device, comm: Comm,
                 optimizer: torch.optim.Optimizer | None = None, loss_fn=None, tp=None, pipe=None):
        self.cfg, self.mesh, self.device, self.comm = cfg, mesh, device, comm
        self.tp_ctx, self.tp_head = tp if tp is not None else (None, None)
        self.module = model
        self.loss_fn = loss_fn
        bs = cfg.batch_sizes(mesh.dp)
        self.train_batch_size, self.micro_batch, self.grad_accum = bs.train_batch_size, bs.micro_batch, bs.grad_accum
        self.dtype = model_dtype(cfg)
        if self.dtype != torch.float32 and optimizer is not None and \
                any(p.dtype != torch.float32 for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("with fp16/bf16 bunsan keeps fp32 master weights itself: build the optimizer over "
                             "the fp32 model and let bunsan cast the model")
        if any(p.is_meta for p in model.parameters()):   # bunsan.zero.Init: ZeRO-3 materialises shards
            model.to(dtype=self.dtype)
        else:
            model.to(device=device, dtype=self.dtype)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            if cfg.lora.enabled:
                raise ValueError(f"rank {mesh.rank} holds no layer named in lora.target_modules "
                                 f"{list(cfg.lora.target_modules)} (a pipeline stage of only the embedding or "
                                 "head?): target more modules, or use fewer pipeline stages")
            raise ValueError("the model has no parameters with requires_grad=True; nothing to train")
        self.dp = make_strategy(trainable, comm, mesh.dp_group, cfg, device, optimizer, model)
        self.dp.set_tensor_parallel(mesh.tp_group if self.tp_ctx is not None else None)
        self.pipe = pipe
        if pipe is not None:
            self.dp.set_pipeline(mesh.pp_group, {model.get_parameter(n) for n in pipe.duplicates})
            pipe.start(comm, mesh, device)
        self.optimizer = self.dp.optimizer
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.schedule = LRSchedule(cfg.scheduler, total_steps=cfg.train.steps)
        self.scaler = LossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else None

        self.global_step = 0
        self.micro_steps = 0        # micro-batches seen in the current optimizer step (DeepSpeed path)
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")
        self._post_scale = 1.0      # multiplies the all-reduced gradients before the step
        comm.stats.new_step()       # the initial broadcast is set-up, not step 1's traffic
        self._last_comm = comm.stats.summary()
        self._set_lr()

    # -- attributes users expect -----------------------------------------------------------------
    dp_rank = property(lambda self: self.mesh.dp_rank)
    dp_size = property(lambda self: self.mesh.dp)
    tp_rank = property(lambda self: self.mesh.tp_rank)
    tp_size = property(lambda self: self.mesh.tp)
    pp_rank = property(lambda self: self.mesh.pp_rank)
    pp_size = property(lambda self: self.mesh.pp)
    loss_scale = property(lambda self: self.scaler.scale if self.scaler else 1.0)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _set_lr(self) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.schedule(self.global_step - self.skipped_steps, base)

    # -- DeepSpeed-style loop --------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._no_pipeline("engine(inputs)")
        if self.micro_steps == 0 and self.device.type == "cuda":   # the reported peak is this step's
            reset_peak_memory(self.device)
        return self.module(*args, **kwargs)

    def _no_pipeline(self, what: str) -> None:
        if self.pipe is not None:
            raise RuntimeError(f"{what}: under pipeline parallelism a rank holds only its stages, so the forward, "
                               "backward and step of one batch run together: call engine.train_batch(batch) "
                               "(and engine.eval_batch(batch)) instead of the DeepSpeed-style loop")

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss; the gradients of the step average over micro-batches and ranks."""
        self._no_pipeline("engine.backward(loss)")
        self._backward(loss / self.grad_accum, sync=self.is_gradient_accumulation_boundary())
        self._post_scale = 1.0 / self.mesh.dp

    def step(self) -> None:
        """Call once per micro-batch; the optimizer steps on the accumulation boundary."""
        self._no_pipeline("engine.step()")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if boundary:
            self._optimizer_step()
            self.micro_steps = 0

    def _backward(self, loss: torch.Tensor, sync: bool) -> None:
        self.dp.begin_backward(sync)
        scale = self.scaler.scale if self.scaler else 1.0
        (loss * scale if scale != 1.0 else loss).backward()
        self.dp.end_backward(sync)

    # -- the optimizer step ----------------------------------------------------------------------
    def _optimizer_step(self, extra: tuple[torch.Tensor, ...] = (), check=None) -> list[float]:
        """Unscale, clip and step. The global gradient norm and `extra` (device scalars the caller wants: the
        step's loss, its token count) are read on the host here, together: the step's one host sync, where it
        must be, since clipping and skipping depend on the norm. `check(extra values)` may refuse the step
        (raise) before anything is applied. Returns the values of `extra`."""
        self.phase = "optimizer step"
        inv = self._post_scale / (self.scaler.scale if self.scaler else 1.0)
        norm_t = self.dp.unscale(inv)
        read = torch.cat([norm_t.reshape(1).double(), *(e.reshape(1).double() for e in extra)])
        norm, *values = read.tolist()   # host: the step's one read (norm, loss, tokens)
        self.comm.clock.settle()        # the step's communication waits are complete: their CUDA events read now
        if check is not None:
            try:
                check(values)
            except Exception:
                self.dp.zero_grad()
                raise
        self.last_grad_norm = norm
        overflow = not math.isfinite(norm)
        if self.scaler:
            self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            if not self.scaler:
                raise FloatingPointError(f"gradient norm is {norm} at step {self.global_step}; the loss or the "
                                         "model produced non-finite values (lower the learning rate or check data)")
        else:
            clip = self.cfg.gradient_clipping
            if clip > 0 and norm > clip:
                self.dp.clip(clip / (norm + 1e-6))
            self.dp.step()
        # As DeepSpeed: every step counts, a skipped (overflow) step does not advance the schedule.
        self.global_step += 1
        self.comm.finished_step = self.global_step
        if self.mesh.world.size > 1:      # for the doctor's roll call, should a collective hang
            post_step(self.mesh.rank, self.global_step)
        self._set_lr()
        self.dp.zero_grad()
        self._last_comm = self.comm.stats.summary()
        self.comm.stats.new_step()
        return values

    # -- whole steps -----------------------------------------------------------------------------
    def _split(self, batch):
        """Split a per-rank batch into gradient_accumulation_steps micro-batches (dim 0)."""
        tensors = batch.values() if isinstance(batch, dict) else batch
        rows = {t.shape[0] for t in tensors}
        expect = self.micro_batch * self.grad_accum
        if rows != {expect}:
            raise ValueError(f"batch has {sorted(rows)} rows per data-parallel rank; expected micro_batch "
                             f"{self.micro_batch} x gradient_accumulation_steps {self.grad_accum} = {expect} "
                             f"(train_batch_size {self.train_batch_size} over {self.mesh.dp} ranks)")
        if isinstance(batch, dict):
            chunks = {k: v.to(self.device, non_blocking=True).chunk(self.grad_accum) for k, v in batch.items()}
            return [{k: v[i] for k, v in chunks.items()} for i in range(self.grad_accum)]
        chunks = [t.to(self.device, non_blocking=True).chunk(self.grad_accum) for t in batch]
        return [tuple(c[i] for c in chunks) for i in range(self.grad_accum)]

    def _lm_loss_sum(self, logits, labels):
        if self.tp_head is not None:   # logits are split by vocabulary: never gather them
            return vocab_parallel_loss_sum(logits, labels, self.tp_head)
        return lm_loss_sum(logits, labels)

    def _micro_loss(self, mb):
        """(summed or mean loss, token count) of one micro-batch."""
        if isinstance(mb, dict) and self.loss_fn is None:
            labels = mb["labels"]
            return self._lm_loss_sum(self.module(mb["input_ids"]), labels), (labels != -100).sum()
        if self.loss_fn is None:
            raise ValueError("pass loss_fn to bunsan.initialize for batches that are not language-model dicts")
        if isinstance(mb, dict):
            return self.loss_fn(self.module(mb["input_ids"]), mb["labels"]), None
        return self.loss_fn(self.module(*mb[:-1]), mb[-1]), None

    def train_batch(self, batch) -> float:
        """One optimizer step over micro_batch x grad_accum rows; the mean loss of the global batch. Running out
        of memory raises OutOfMemory, whose message says where, what was held and which layouts would fit."""
        self.phase = "forward"
        try:
            return self._train_batch(batch)
        except Exception as e:
            if not is_oom(e):
                raise
            seq = batch["input_ids"].shape[-1] if isinstance(batch, dict) and "input_ids" in batch else None
            where = self.phase + (f", ZeRO-3 unit {self.dp.current_unit}" if getattr(self.dp, "current_unit", None)
                                  else "")
            raise OutOfMemory(explain(self, where, seq, e)) from e

    def _train_batch(self, batch) -> float:
        self.module.train()
        if self.device.type == "cuda":     # the reported peak is this step's, not set-up's
            reset_peak_memory(self.device)
        micro = self._split(batch)
        lm = isinstance(batch, dict) and self.loss_fn is None
        check, n_global = None, None
        if lm:
            # The global mean over tokens: summed losses divided by the token count of the whole global batch,
            # counted and reduced on the device (read with the norm; a global batch of no tokens is refused then).
            n_global = torch.stack([(mb["labels"] != -100).sum() for mb in micro]).sum().double().reshape(1)
            self.comm.all_reduce(n_global, self.mesh.dp_group)
            # (in fp32, as the loss: a float64 divisor would promote the loss and round its gradient twice)
            div, self._post_scale = n_global[0].clamp(min=1.0).float(), 1.0
            check = _refuse_empty_batch
        else:
            div, self._post_scale = self.grad_accum, 1.0 / self.mesh.dp
        if self.pipe is not None:
            total = pipeline_step.run_schedule(self, micro, lm, div)
        else:
            total = torch.zeros(1, dtype=torch.float64, device=self.device)
            for i, mb in enumerate(micro):
                self.phase = f"forward of micro-batch {i + 1}/{len(micro)}"
                loss, _ = self._micro_loss(mb)
                self.phase = f"backward of micro-batch {i + 1}/{len(micro)}"
                self._backward(loss / div, sync=i == len(micro) - 1)
                total += loss.detach().double()
        self.comm.all_reduce(total, self.mesh.dp_group)
        self.micro_steps = 0
        if lm:
            summed, tokens = self._optimizer_step((total, n_global), check)
            return summed / tokens
        summed, = self._optimizer_step((total,))
        return summed / (self.grad_accum * self.mesh.dp)

    @torch.no_grad()
    def eval_batch(self, batch) -> float:
        """Mean loss over a per-rank batch (any number of rows), averaged over the data-parallel group."""
        self.module.eval()
        if self.pipe is not None:
            try:
                return pipeline_step.eval_batch(self, batch)
            finally:
                self.module.train()
        try:
            if isinstance(batch, dict) and self.loss_fn is None:
                labels = batch["labels"].to(self.device)
                s = self._lm_loss_sum(self.module(batch["input_ids"].to(self.device)), labels).double()
                sums = torch.stack([s, (labels != -100).sum().double()])
                self.comm.all_reduce(sums, self.mesh.dp_group)
                total, n = sums.tolist()   # host: evaluation returns a number
                return total / n
            loss, _ = self._micro_loss(tuple(t.to(self.device) for t in batch) if not isinstance(batch, dict)
                                       else {k: v.to(self.device) for k, v in batch.items()})
            loss = loss.detach().double().reshape(1)
            self.comm.all_reduce(loss, self.mesh.dp_group)
            return loss.tolist()[0] / self.mesh.dp   # host: evaluation returns a number
        finally:
            self.module.train()

    # -- introspection ---------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full plain-model state dict (same keys as the unwrapped model), on every rank, on CPU."""
        state = self.dp.consolidated_state_dict(self.module)
        if self.tp_ctx is not None:
            state = consolidate(state, self.module, self.tp_ctx, self.device)
        if self.pipe is not None:
            state = gather_stages(state, self.comm, self.mesh.pp_group, self.device)
        return state

    def pipeline_timeline(self) -> list | None:
        """What every pipeline rank did in the last step (timeline.Interval lists, by pipeline rank), on every
        rank of the pipeline group; None without pipeline parallelism. Collective over the pipeline group."""
        if self.pipe is None:
            return None
        return gather_intervals(self.pipe.recorder.intervals, self.comm, self.mesh.pp_group, self.device)

    def gathered_parameters(self):
        """Context in which every parameter holds its full value (ZeRO-3 gathers and releases after)."""
        gathered = getattr(self.dp, "gathered", None)
        return gathered() if gathered is not None else contextlib.nullcontext()

    def comm_stats(self) -> dict:
        """Communication of the last completed optimizer step and totals since start."""
        return self._last_comm

    def memory_report(self) -> dict:
        return measured_memory(self)

    # -- checkpoints (checkpoint/) ---------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: dict | None = None,
                        keep_last: int | None = None):
        """Every rank: its shards as safetensors, atomically; `client_state` (JSON-able) comes back on load."""
        from bunsan.checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, keep_last)

    def load_checkpoint(self, load_dir, tag: str | None = None, load_optimizer_states: bool = True):
        """Every rank: (path, client_state). Any layout's checkpoint loads into this one."""
        from bunsan.checkpoint import load_checkpoint
        return load_checkpoint(self, load_dir, tag, load_optimizer_states)
