"""The shape and routing rules of bunsan's mixture-of-experts block (models/moe.py), checked field by field.

One config covers the token-choice routers of the published MoE families:

  Mixtral, Qwen3-MoE   softmax scores, top-k, renormalised over the k, auxiliary loss
  DeepSeek-V2          softmax, group-limited (group score: its best expert), shared experts
  DeepSeek-V3          sigmoid, group-limited (group score: its best two), renormalised, scaled by
                       route_scale, balanced by a non-trainable expert bias instead of an auxiliary loss
  Switch, ST-MoE       top-1, capacity factor with dropped tokens, router z-loss
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
EXPERT_KERNELS = ("auto", "grouped_mm", "loop")

_POSITIVE_INTS = ("hidden_size", "num_experts", "top_k", "expert_intermediate_size", "n_groups", "topk_groups")
_NON_NEGATIVE_NUMBERS = ("aux_loss_coef", "z_loss_coef", "expert_bias_update_rate")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class MoEConfig:
    """A token-choice top-k MoE block: `num_experts` SwiGLU experts of width `expert_intermediate_size`, each
    token sent to `top_k` of them, plus `num_shared_experts` that every token goes through."""

    hidden_size: int = 256
    num_experts: int = 8
    top_k: int = 2
    expert_intermediate_size: int = 512
    # Shared experts: one dense SwiGLU MLP that every token passes, added to the routed output (DeepSeek).
    # Its width: shared_intermediate_size, or None -> num_shared_experts * expert_intermediate_size (the
    # DeepSeek checkpoints' convention: n shared experts fused into one MLP n times as wide)
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    # Router scores: "softmax" over the experts (Mixtral, Qwen, DeepSeek-V2) or an independent "sigmoid" per
    # expert (DeepSeek-V3)
    score_func: str = "softmax"
    # Renormalise the k selected scores to sum 1 before they weight the experts' outputs. None -> True for
    # sigmoid (its scores do not sum to 1 at all), False for softmax (as torchtitan; Mixtral and Qwen3 set True)
    route_norm: bool | None = None
    # Multiplies the combine weights (DeepSeek-V3's routed_scaling_factor, 2.5 there)
    route_scale: float = 1.0
    # Group-limited routing: experts split into n_groups consecutive groups (one per node in DeepSeek's
    # deployment, so a token's experts span few nodes); only the best topk_groups groups may be chosen
    n_groups: int = 1
    topk_groups: int = 1
    # Load balancing: Switch/GShard auxiliary loss, ST-MoE router z-loss (0 = off), and DeepSeek-V3's
    # auxiliary-loss-free expert bias, moved by this much per optimizer step (0 = the bias never moves)
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias_update_rate: float = 0.0
    # None: dropless (every assignment computed). A factor c caps each expert at ceil(c * tokens * top_k /
    # num_experts) assignments per forward; the rest are dropped ("probs": the lowest-weighted go first,
    # "position": the later tokens go first) and pass through the residual (and shared experts) only
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    # How the experts compute: "grouped_mm" (torch._grouped_mm, one kernel for all experts), "loop" (one
    # matmul per expert), or "auto" (grouped_mm where a probe shows it runs for the device, dtype and widths)
    expert_kernel: str = "auto"

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {v!r}")
        v = self.num_shared_experts
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be an int >= 0 (0: no shared experts), got {v!r}")
        self._check_shared_width()
        self._check_routing()
        for name in _NON_NEGATIVE_NUMBERS:
            v = getattr(self, name)
            if not _is_number(v) or v < 0:
                raise ValueError(f"MoEConfig.{name} must be a finite number >= 0 (0 = off), got {v!r}")
        c = self.capacity_factor
        if c is not None and (not _is_number(c) or c <= 0):
            raise ValueError(f"MoEConfig.capacity_factor must be None (dropless) or a number > 0 (1.0: each "
                             f"expert takes its even share of the assignments), got {c!r}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"MoEConfig.drop_policy {self.drop_policy!r} is not one of {DROP_POLICIES}")
        if self.expert_kernel not in EXPERT_KERNELS:
            raise ValueError(f"MoEConfig.expert_kernel {self.expert_kernel!r} is not one of {EXPERT_KERNELS}")

    def _check_shared_width(self) -> None:
        w = self.shared_intermediate_size
        if w is None:
            return
        if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
            raise ValueError(f"MoEConfig.shared_intermediate_size must be a positive int or None, got {w!r}")
        if self.num_shared_experts == 0:
            raise ValueError(f"MoEConfig.shared_intermediate_size is {w} but num_shared_experts is 0; set "
                             f"num_shared_experts >= 1 to add shared experts, or leave the width None")

    def _check_routing(self) -> None:
        e, k, g, kg = self.num_experts, self.top_k, self.n_groups, self.topk_groups
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEConfig.score_func {self.score_func!r} is not one of {SCORE_FUNCS}")
        if self.route_norm is not None and not isinstance(self.route_norm, bool):
            raise ValueError(f"MoEConfig.route_norm must be True, False or None (None: True for sigmoid, "
                             f"False for softmax), got {self.route_norm!r}")
        if not _is_number(self.route_scale) or self.route_scale <= 0:
            raise ValueError(f"MoEConfig.route_scale must be a finite number > 0, got {self.route_scale!r}")
        if k > e:
            raise ValueError(f"MoEConfig.top_k {k} exceeds num_experts {e}; a token cannot pick more experts "
                             f"than there are: set top_k <= {e}")
        if e % g:
            raise ValueError(f"MoEConfig.num_experts {e} is not divisible by n_groups {g}; the groups must be "
                             f"equal: pick n_groups among the divisors of {e}")
        if kg > g:
            raise ValueError(f"MoEConfig.topk_groups {kg} exceeds n_groups {g}; set topk_groups <= {g}")
        if k > kg * (e // g):
            raise ValueError(f"MoEConfig.top_k {k} cannot be met inside topk_groups {kg} groups of {e // g} "
                             f"experts ({kg * (e // g)} experts kept); raise topk_groups or lower top_k")

    @property
    def normalizes_routes(self) -> bool:
        """Whether the k selected scores are renormalised to sum 1 (route_norm, resolved)."""
        return self.score_func == "sigmoid" if self.route_norm is None else self.route_norm

    @property
    def shared_width(self) -> int:
        """The shared MLP's intermediate width (0: no shared experts)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_intermediate_size or self.num_shared_experts * self.expert_intermediate_size

    def capacity(self, num_tokens: int) -> int | None:
        """The most assignments one expert takes in a forward of `num_tokens` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
