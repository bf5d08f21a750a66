"""The DeepSpeed-style loop on bunsan's Engine: `engine(inputs)`, `engine.backward(loss)` and `engine.step()` per
micro-batch, the accumulation boundary counted or set by the caller (DeepSpeed's
`set_gradient_accumulation_boundary`, which accelerate calls for transformers' Trainer), and `no_sync()`.

A mixin of Engine (engine.py), whose state it reads: `_micro_steps`, `_backwards`, `_boundary`, `_no_sync`,
and whose `_backward` and `_optimizer_step` run the work.
"""

from __future__ import annotations

import contextlib

import torch

from bunsan.engine.batch import without_kv_cache
from bunsan.memory.measure import reset_peak_memory


class DeepSpeedLoop:
    def __call__(self, *args, **kwargs):
        self._whole_step_only("engine(inputs)")
        if self._micro_steps == 0 and self.device.type == "cuda":   # the reported peak is this step's
            reset_peak_memory(self.device)
        # backward(loss) takes a mean per micro-batch, divided by the accumulation and averaged over the ranks:
        # the MoE blocks' balancing losses get the same weight (engine/moe_step.py)
        self.moe.set_aux_scale((self.scaler.scale if self.scaler else 1.0) / self.grad_accum)
        return self.module(*args, **without_kv_cache(self.module, kwargs))

    def _whole_step_only(self, what: str) -> None:
        if self.cp is not None:
            raise RuntimeError(f"{what}: under context parallelism each rank holds a share of every row's tokens, "
                               "cut from the batch by the engine: call engine.train_batch(batch) (and "
                               "engine.eval_batch(batch)) with whole rows instead of the DeepSpeed-style loop")
        if self.pipe is not None:
            raise RuntimeError(f"{what}: under pipeline parallelism a rank holds only its stages, so the forward, "
                               "backward and step of one batch run together: call engine.train_batch(batch) "
                               "(and engine.eval_batch(batch)) instead of the DeepSpeed-style loop")

    forward = __call__

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch ends a step: as set_gradient_accumulation_boundary last said, else
        every gradient_accumulation_steps-th micro-batch."""
        if self._boundary is not None:
            return self._boundary
        return (self._micro_steps + 1) % self.grad_accum == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: from now on the caller says which micro-batch ends a step (accelerate, for transformers'
        Trainer, says it before every backward, the last shorter accumulation of an epoch included). The loss
        each backward gets is the caller's to scale (the Trainer passes scale_wrt_gas=False)."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary({is_boundary!r}): takes True or False")
        self._boundary = is_boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-batch's mean loss; the gradients of the step average over micro-batches and
        ranks (a mean per micro-batch: the step multiplies the reduced sum by 1/dp). `scale_wrt_gas=False`
        (DeepSpeed's): the loss is not divided by gradient_accumulation_steps."""
        self._whole_step_only("engine.backward(loss)")
        scale = self.scaler.scale if self.scaler else 1.0
        if scale_wrt_gas:
            loss = loss / self.grad_accum
        sync = self.is_gradient_accumulation_boundary() and not self._no_sync
        self._backward(loss * scale if scale != 1.0 else loss, sync=sync)
        self._backwards += 1

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside keeps gradients on this rank (accumulated); the first backward on an accumulation
        boundary outside reduces them all. engine.step() inside is an error, as in DeepSpeed."""
        if self.strategy.stage >= 2:
            raise RuntimeError(f"no_sync() with ZeRO stage {self.strategy.stage}: stages 2 and 3 reduce and "
                               "partition gradients during every backward; use stage 0 or 1, or raise "
                               "gradient_accumulation_steps instead")
        if self._no_sync:
            raise RuntimeError("no_sync() is already active; it does not nest")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def step(self) -> None:
        """Call once per micro-batch (or only on boundaries, as accelerate does); the optimizer steps on the
        accumulation boundary."""
        self._whole_step_only("engine.step()")
        if self._no_sync:
            raise RuntimeError("engine.step() inside no_sync(): the gradients are not reduced yet; leave the "
                               "no_sync() block, run one more backward, then step")
        if self.is_gradient_accumulation_boundary():
            if not self._backwards:
                raise RuntimeError("engine.step() on an accumulation boundary with no backward since the last "
                                   "step: there are no gradients to apply; call engine.backward(loss) first")
            self._optimizer_step(1.0 / self.mesh.dp)
        else:
            self._micro_steps += 1
