"""Mixed precision: the model's dtype, fp16.auto_cast of forward inputs and the fp16 dynamic loss scaler.

Semantics follow DeepSpeed's DynamicLossScaler so that a DeepSpeed user's `fp16`
section behaves the same: start at 2**initial_scale_power; on an overflow the step
is skipped and, once `hysteresis` overflows have been absorbed, the scale halves
(never below `min_loss_scale`); after `loss_scale_window` clean steps it doubles.
Overflowing while already at the minimum is an error rather than an endless run
of skipped steps.
"""

from __future__ import annotations

import torch


class LossScaleError(RuntimeError):
    pass


def model_dtype(cfg) -> torch.dtype:
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float32


def half_inputs(inputs):
    """DeepSpeed's fp16.auto_cast: floating-point tensors among the positional inputs, inside lists, tuples
    and dicts too, in float16; anything else (token ids, masks of bool) as it is."""
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(half_inputs(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: half_inputs(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.half()
    return inputs


def cast_inputs_to_half(module: torch.nn.Module):
    """The float16 model's forward takes float32 inputs from the script's data: every call of `module` casts
    its positional inputs first (keyword arguments are left as they are, as DeepSpeed leaves them)."""
    return module.register_forward_pre_hook(lambda _, args: half_inputs(args))


class LossScaler:
    """Dynamic (or static, when `static_scale` > 0) loss scale with DeepSpeed's update rule."""

    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, consecutive_hysteresis: bool = False, static_scale: float = 0.0,
                 scale_factor: float = 2.0):
        self.dynamic = not static_scale
        self.scale = float(static_scale) if static_scale else float(2 ** initial_scale_power)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.cur_hysteresis = hysteresis
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = scale_factor
        self.iter = 0
        self.last_overflow_iter = -1
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        return cls(fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale,
                   fp16.consecutive_hysteresis, fp16.loss_scale)

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale."""
        if overflow:
            self.skipped_steps += 1
        if self.dynamic:
            if overflow:
                if self.hysteresis == 1 or self.cur_hysteresis == 1:
                    if self.scale <= self.min_scale:
                        raise LossScaleError(
                            f"fp16 gradients overflowed at the minimum loss scale {self.min_scale:g} "
                            f"(step {self.iter}); the model diverged or fp16 cannot represent it: lower the "
                            "learning rate, enable gradient_clipping, or use bf16 (bf16.enabled: true)")
                    self.scale = max(self.scale / self.factor, self.min_scale)
                else:
                    self.cur_hysteresis -= 1
                self.last_overflow_iter = self.iter
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                if (self.iter - self.last_overflow_iter) % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.hysteresis
                    self.scale *= self.factor
        self.iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "cur_hysteresis", "iter", "last_overflow_iter",
                                              "skipped_steps")}

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)
