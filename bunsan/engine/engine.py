"""The training engine: the step loop, loss scaling, clipping and the schedule around a data-parallel strategy.

One optimizer step = `gradient_accumulation_steps` micro-batches per data-parallel
rank. Two ways to drive it:

    loss = engine.train_batch(batch)          # the whole step; returns the global mean loss
    out = engine(x); engine.backward(loss); engine.step()   # DeepSpeed-style, once per micro-batch

Where gradients, master weights and optimizer states live is the strategy's
business (zero/: the interface in strategy.py, stages 0-3 beside it); tensor
parallelism has already swapped the model's layers when the engine is built.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from bunsan.comm.collectives import Comm
from bunsan.comm.mesh import Mesh
from bunsan.comm.rollcall import post_step
from bunsan.context_parallel import shard_batch
from bunsan.doctor.oom import OutOfMemory, explain, is_oom
from bunsan.expert_parallel import consolidate as consolidate_experts
from bunsan.engine.batch import Objective, check_cut, rows_of, split
from bunsan.engine.ds_loop import DeepSpeedLoop
from bunsan.engine.media import check_rows
from bunsan.engine.moe_step import MoESteps
from bunsan.engine.preference import objective_for
from bunsan.engine.precision import LossScaler, cast_inputs_to_half, model_dtype
from bunsan.memory.measure import measured_memory, reset_peak_memory
from bunsan.models.loss import lm_loss_sum
from bunsan.optim.lrs import restore_lrs
from bunsan.optim.schedule import LRSchedule
from bunsan.pipeline import forward_backward as pipeline
from bunsan.pipeline.consolidate import gather_intervals, gather_stages
from bunsan.tensor_parallel import consolidate, vocab_parallel_loss_sum
from bunsan.zero.gathered import gathered_parameters
from bunsan.zero.strategy import Strategy


def _refuse_empty_batch(values: list[float]) -> None:
    if values[1] == 0:
        raise ValueError("every label in the global batch is -100; nothing to learn from")


class Engine(DeepSpeedLoop):
    """The step around a data-parallel strategy (`strategy`, built by bunsan.initialize over the transformed
    model): loss, loss scaling, clipping, the learning-rate schedule and the step counters."""

    def __init__(self, model: nn.Module, cfg, mesh: Mesh, device: torch.device, comm: Comm, strategy: Strategy,
                 loss_fn=None, tp=None, pipe=None, cp=None, ep=None):
        self.cfg, self.mesh, self.device, self.comm = cfg, mesh, device, comm
        self.cp = cp                # context parallelism's CPContext: this rank holds a share of each row
        self.ep = ep                # expert parallelism's EPContext: this rank holds a share of the experts
        self.moe = MoESteps(model, comm, mesh.grad_group)     # balancing losses, expert bias, load metrics
        self.tp_ctx, self.tp_head = tp if tp is not None else (None, None)
        if self.tp_head is not None:
            # What reaches the user (engine(inputs), a loss_fn, a Hugging Face model's own loss) is the whole
            # vocabulary's logits; only the engine's own loss reads each rank's slice (_logits_for)
            self.tp_head.gather_output = True
        self.module = model
        self.loss_fn = loss_fn
        bs = cfg.batch_sizes(mesh.dp)
        self.train_batch_size, self.micro_batch, self.grad_accum = bs.train_batch_size, bs.micro_batch, bs.grad_accum
        self.dtype = model_dtype(cfg)
        self.strategy = strategy    # the data-parallel strategy (zero/): where gradients and states live
        self.pipe = pipe
        if pipe is not None:
            pipe.start(comm, mesh, device)
        self.optimizer = self.strategy.optimizer
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.schedule = LRSchedule(cfg.scheduler, total_steps=cfg.train.steps)
        self.scaler = LossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else None
        if cfg.fp16.enabled and cfg.fp16.auto_cast:
            cast_inputs_to_half(model)

        self.global_step = 0
        self._micro_steps = 0       # micro-batches seen in the current optimizer step (DeepSpeed-style loop)
        self._backwards = 0         # backward passes whose gradients wait for the next optimizer step
        self._boundary: bool | None = None   # set_gradient_accumulation_boundary's; None: counted
        self._no_sync = False       # inside no_sync(): backward keeps gradients local
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")
        self.phase = "set-up"       # what runs now, for the doctor's out-of-memory advice
        comm.stats.new_step()       # the initial broadcast is set-up, not step 1's traffic
        self._last_comm = comm.stats.summary()
        self._set_lr()

    # -- attributes users expect -----------------------------------------------------------------
    dp_rank = property(lambda self: self.mesh.dp_rank)
    dp_size = property(lambda self: self.mesh.dp)
    tp_rank = property(lambda self: self.mesh.tp_rank)
    tp_size = property(lambda self: self.mesh.tp)
    pp_rank = property(lambda self: self.mesh.pp_rank)
    cp_rank = property(lambda self: self.mesh.cp_rank)
    cp_size = property(lambda self: self.mesh.cp)
    pp_size = property(lambda self: self.mesh.pp)
    loss_scale = property(lambda self: self.scaler.scale if self.scaler else 1.0)

    micro_steps = property(lambda self: self._micro_steps, doc="micro-batches done in the current step")
    accumulated = property(lambda self: self._backwards,
                           doc="backward passes whose gradients wait for the next optimizer step")

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        """The engine's own state, what a checkpoint needs besides model and optimizer: step counters and the
        loss scaler (the learning rate follows from them). JSON-able."""
        if self._backwards:
            raise RuntimeError(f"the engine is in the middle of an optimizer step ({self._backwards} micro-batches' "
                               "gradients accumulated): save after engine.step() completes one")
        return {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        self.global_step, self.skipped_steps, self._micro_steps = state["global_step"], state["skipped_steps"], 0
        self._backwards = 0
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.cfg.scheduler is None and state.get("lrs") is not None:
            restore_lrs(self.optimizer, self.base_lrs, state["lrs"])
        self._set_lr()

    def _set_lr(self) -> None:
        if self.cfg.scheduler is None:     # the rates belong to whoever built the optimizer (optim/lrs.py)
            return
        self.schedule.apply(self.optimizer.param_groups, self.base_lrs, self.global_step - self.skipped_steps)

    def _backward(self, loss: torch.Tensor, sync: bool) -> None:
        """Backward of an already divided and scaled loss; `sync`: this micro-batch's gradients are final."""
        self.strategy.begin_backward(sync)
        loss.backward()
        self.strategy.end_backward(sync)

    # -- the optimizer step ----------------------------------------------------------------------
    def _optimizer_step(self, post_scale: float, extra: tuple[torch.Tensor, ...] = (), check=None) -> list[float]:
        """Unscale, clip and step. The global gradient norm and `extra` (device scalars the caller wants: the
        step's loss, its token count) are read on the host here, together: the step's one host sync, where it
        must be, since clipping and skipping depend on the norm. `check(extra values)` may refuse the step
        (raise) before anything is applied. Returns the values of `extra`."""
        self.phase = "optimizer step"
        norm_t = self.strategy.unscale(post_scale / (self.scaler.scale if self.scaler else 1.0))
        read = torch.cat([norm_t.reshape(1).double(), *(e.reshape(1).double() for e in extra)])
        norm, *values = read.tolist()   # host: the step's one read (norm, loss, tokens)
        self.comm.clock.settle()        # the step's communication waits are complete: their CUDA events read now
        if check is not None:
            try:
                check(values)
            except Exception:
                self.strategy.zero_grad()
                raise
        self.last_grad_norm = norm
        overflow = not math.isfinite(norm)
        self.moe.after_step(applied=not overflow)
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
                self.strategy.clip(clip / (norm + 1e-6))
            self.strategy.step()
        self._finish_step()
        return values

    def _finish_step(self) -> None:
        """As DeepSpeed: every step counts, a skipped (overflow) step does not advance the schedule."""
        self.global_step += 1
        self._micro_steps = self._backwards = 0
        self.comm.finished_step = self.global_step
        if self.mesh.world.size > 1:      # for the roll call, should a collective hang
            post_step(self.mesh.rank, self.global_step)
        self._set_lr()
        self.strategy.zero_grad()
        self._last_comm = self.comm.stats.summary()
        self.comm.stats.new_step()

    # -- the step: one for every layout ----------------------------------------------------------
    def _lm_loss_sum(self, logits, labels):
        if self.tp_head is not None:   # logits are split by vocabulary: never gather them
            return vocab_parallel_loss_sum(logits, labels, self.tp_head)
        return lm_loss_sum(logits, labels)

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
            unit = self.strategy.current_unit
            raise OutOfMemory(explain(self, self.phase + (f", ZeRO-3 unit {unit}" if unit else ""), seq, e)) from e

    def _train_batch(self, batch) -> float:
        self.module.train()
        if self.device.type == "cuda":     # the reported peak is this step's, not set-up's
            reset_peak_memory(self.device)
        objective = objective_for(self, batch)
        self._lm_only(objective)
        micro = self._split(batch)
        objective.scale = self.scaler.scale if self.scaler else 1.0
        if objective.lm:
            # The global mean over tokens: summed losses divided by the token count of the whole global batch,
            # counted and reduced on the device (read with the norm; a global batch of no tokens is refused then).
            tokens = objective.tokens(micro)
            self.comm.all_reduce(tokens, self.mesh.grad_group)
            # (in fp32, as the loss: a float64 divisor would promote the loss and round its gradient twice)
            objective.div = tokens[0].clamp(min=1.0).float()
        else:
            objective.div, objective.post_scale = self.grad_accum, 1.0 / self.mesh.dp
        # each replica's mean balancing loss per micro-batch, in the units the reduced gradients are read in
        self.moe.set_aux_scale(objective.scale / (len(micro) * self.mesh.grad_group.size * objective.post_scale))
        with self._logits_for(objective):
            total = self._forward_backward(micro, objective)
        self.comm.all_reduce(total, self.mesh.grad_group)
        if objective.lm:
            summed, n = self._optimizer_step(objective.post_scale, (total, tokens), _refuse_empty_batch)
            return summed / n
        summed, = self._optimizer_step(objective.post_scale, (total,))
        return summed / (self.grad_accum * self.mesh.dp)

    def _split(self, batch) -> list:
        """A per-rank batch as gradient_accumulation_steps micro-batches (dim 0), on the device."""
        check_rows(batch)                     # names a tensor that is not one entry per row
        rows, expect = rows_of(batch), self.micro_batch * self.grad_accum
        if rows != {expect}:
            raise ValueError(f"batch has {sorted(rows)} rows per data-parallel rank; expected micro_batch "
                             f"{self.micro_batch} x gradient_accumulation_steps {self.grad_accum} = {expect} "
                             f"(train_batch_size {self.train_batch_size} over {self.mesh.dp} ranks)")
        return self._cut(split(batch, self.grad_accum, self.device))

    def _cut(self, micro: list) -> list:
        """Context parallelism: each micro-batch's rows cut to this rank's tokens (its two balanced chunks)."""
        check_cut(micro, self.cp is not None, self.cfg.tensor_parallel.sequence_parallel)
        if self.cp is None:
            return micro
        return [shard_batch(mb, self.cp.size, self.cp.rank) for mb in micro]

    def _lm_only(self, objective: Objective) -> None:
        if self.cp is not None:
            objective.check_context_parallel()

    def _forward_backward(self, micro: list, objective: Objective) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's summed loss (a device tensor). A pipeline
        runs them in its schedule's order; otherwise one after another, the last one reducing gradients."""
        if self.pipe is not None:
            return pipeline.forward_backward(self.pipe, micro, objective, self.strategy, self.module, self._set_phase)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro):
            self.phase = f"forward of micro-batch {i + 1}/{len(micro)}"
            loss, reported = objective(objective.forward(self.module, mb), mb)
            self.phase = f"backward of micro-batch {i + 1}/{len(micro)}"
            self._backward(loss, sync=i == len(micro) - 1)
            total += reported.detach().double()
        return total

    def _logits_for(self, objective: Objective):
        """The vocabulary-parallel head gives slices to the engine's loss, whole logits to anything else."""
        if self.tp_head is not None and objective.lm:
            return self.tp_head.slices()
        return contextlib.nullcontext()

    def _set_phase(self, phase: str) -> None:
        self.phase = phase

    @torch.no_grad()
    def eval_batch(self, batch) -> float:
        """Mean loss over a per-rank batch (any number of rows), averaged over the data-parallel group: over
        tokens for language-model batches, over rows for a loss_fn."""
        self.module.eval()
        try:
            objective = objective_for(self, batch)
            self._lm_only(objective)
            rows = max(rows_of(batch))
            # a pipeline needs micro-batches to fill its stages; up to grad_accum of them, as in training
            micro = self._cut(split(batch, max(1, min(rows, self.grad_accum)) if self.pipe is not None else 1,
                                    self.device))
            with self._logits_for(objective):
                if self.pipe is not None:
                    with self.strategy.pipeline_evaluation():
                        total = pipeline.forward(self.pipe, micro, objective)
                else:
                    total = objective.summed(objective.forward(self.module, micro[0]), micro[0]).double().reshape(1)
            sums = torch.cat([total, objective.count(micro)])
            self.comm.all_reduce(sums, self.mesh.grad_group)
            summed, n = sums.tolist()   # host: evaluation returns a number
            return summed / n
        finally:
            self.module.train()

    # -- introspection ---------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full plain-model state dict (same keys as the unwrapped model), on every rank, on CPU."""
        state = self.strategy.consolidated_state_dict(self.module)
        if self.ep is not None:
            state = consolidate_experts(state, self.module, self.ep, self.device)
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

    def gathered_parameters(self, modifier_rank: int | None = None):
        """Context in which every parameter holds its full value (ZeRO-3 gathers and releases after). With
        `modifier_rank` (a data-parallel rank) what that rank writes is kept on every rank, as DeepSpeed's
        GatheredParameters; without, the parameters are read-only and a write is an error."""
        return gathered_parameters(self.strategy, self.comm, self.mesh.grad_group, self.module, modifier_rank)

    def comm_stats(self) -> dict:
        """Communication of the last completed optimizer step and totals since start."""
        return self._last_comm

    def memory_report(self) -> dict:
        return measured_memory(self)

    # -- checkpoints (checkpoint/) ---------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | float | None = None, client_state: dict | None = None,
                        keep_last: int | None = None):
        """Every rank: its shards as safetensors, atomically; `client_state` (JSON-able) comes back on load."""
        from bunsan.checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, keep_last)

    def load_hf_weights(self, path) -> None:
        """A Hugging Face directory's weights (safetensors) into this engine, on any layout: every rank reads only
        the slices it holds (tensor-parallel rows; ZeRO shards). Optimizer states stay fresh."""
        from bunsan.checkpoint.hf import load_hf_into_engine
        load_hf_into_engine(self, path)

    def load_checkpoint(self, load_dir, tag: str | None = None, load_optimizer_states: bool = True):
        """Every rank: (path, client_state). Any layout's checkpoint loads into this one."""
        from bunsan.checkpoint import load_checkpoint
        return load_checkpoint(self, load_dir, tag, load_optimizer_states)
