"""Memory theory: what the model states of one rank should take, in one place.

Used by the engine's memory report (measure.py), the estimator and the planner.
Two accountings:
- the ZeRO paper's (`zero_paper`, `model_state_bytes`): Ψ parameters, K optimizer
  bytes per parameter; parameters and gradients in the model dtype, fp32 master
  weights when the model is 16-bit, plus the optimizer's own state;
- bunsan's buffers as allocated (`model_states`): the flat parameter buffer and its
  gradients are padded per bucket to a multiple of N x 16 elements; stages 2 and 3
  keep the gradient shard in fp32 (micro-steps add without 16-bit rounding), where
  the ZeRO paper counts 16-bit gradients; an fp32 model is its own master copy.
  It says where each kind lives (device, host or disk) for each offload setting (`placement`).
Beside the resident states, the transients of the ZeRO stages: the gradient shard the optimizer steps,
ZeRO-3's gathered units, the gradient buckets in flight, the NVMe swap-in.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from bunsan.optim.stepping import state_bytes_per_param
from bunsan.zero.layout import ALIGN, ShardLayout
from bunsan.zero.reduce import IN_FLIGHT

if TYPE_CHECKING:   # the estimator builds it; theory only reads its fields
    from bunsan.estimator.rank_params import RankParams


def optimizer_state_bytes_per_param(opt_type: str, params: dict | None = None) -> float:
    """K without master weights: fp32 state bytes per parameter (dense estimate; optim/stepping.py's table).
    Adafactor's are factored and depend on shapes: adafactor_state_bytes."""
    return state_bytes_per_param(opt_type, params)


def adafactor_state_bytes(shapes) -> int:
    """torch.optim.Adafactor keeps row and column second moments for matrices, a full one for vectors."""
    total = 0
    for shape in shapes:
        if len(shape) >= 2:  # row_var (..., R, 1) and col_var (..., 1, C)
            lead = math.prod(shape[:-2])
            total += 4 * lead * (shape[-2] + shape[-1])
        else:
            total += 4 * math.prod(shape)
    return total


def model_state_bytes(psi: int, dtype_bytes: int, opt_bytes_per_param: float, dp: int = 1, stage: int = 0,
                      grad_shard_bytes: int | None = None) -> dict:
    """Predicted model-state bytes per rank for ZeRO stage `stage` over `dp` ranks.

    The ZeRO paper counts 16-bit gradient shards at stages 2-3; bunsan accumulates the
    shard in fp32 (grad_shard_bytes=4) so that micro-steps add without 16-bit rounding.
    """
    master = 4 if dtype_bytes < 4 else 0
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[stage]
    grad_bytes = grad_shard_bytes if (grad_shard_bytes and stage >= 2) else dtype_bytes
    out = {"params": psi * dtype_bytes / shard[0], "grads": psi * grad_bytes / shard[1],
           "master_weights": psi * master / shard[2], "optimizer_states": psi * opt_bytes_per_param / shard[2]}
    out["total"] = out["params"] + out["grads"] + out["master_weights"] + out["optimizer_states"]
    return out


# bitsandbytes 8-bit AdamW: two 1-byte states per element plus an fp32 absmax per block of 256; tensors
# under 4096 elements keep 32-bit states (its min_8bit_size).
BNB_BLOCK, BNB_MIN_8BIT = 256, 4096


def optimizer_bytes(opt: str, shapes: list[tuple[int, ...]], params: dict | None = None,
                    numels: list[int] | None = None) -> float:
    """Optimizer-state bytes of these (whole) tensors, master weights excluded (`numels`: their element counts,
    where the caller has them)."""
    t = opt.lower()
    numels = numels if numels is not None else [math.prod(s) for s in shapes]
    if t == "adafactor":
        return adafactor_state_bytes(shapes)
    if t in ("adamw8bit", "adamw_8bit", "adam8bit"):   # + two 256-entry fp32 quantisation maps per tensor
        return sum(2 * n + 2 * 4 * -(-n // BNB_BLOCK) + 2 * 256 * 4 if n >= BNB_MIN_8BIT else 8 * n for n in numels)
    return optimizer_state_bytes_per_param(t, params) * sum(numels)


def bucket_sizes(numels: list[int], bucket_elems: int, stage: int, units: list[int] | None = None) -> list[int]:
    """Elements of each gradient bucket: stage 3 reduces unit by unit, stages 0-2 group parameters in
    backward order as the strategies do (ShardLayout.greedy_buckets)."""
    if stage == 3 and units is not None:
        return list(units)
    return list(_backward_buckets(tuple(numels), bucket_elems))


@functools.lru_cache(maxsize=4096)
def _backward_buckets(numels: tuple[int, ...], bucket_elems: int) -> tuple[int, ...]:
    # (cached: the planner prices thousands of layouts over a few distinct ranks' parameter lists)
    back = numels[::-1]
    return tuple(sum(back[i] for i in group) for group in ShardLayout.greedy_buckets(list(back), bucket_elems))


def padded(numels: list[int], n: int, bucket_elems: int, stage: int, units: list[int] | None = None) -> int:
    """Elements of the flat buffer: buckets padded to n x ALIGN (stage 0: one rank, no padding)."""
    if stage == 0:
        return sum(numels)
    groups = bucket_sizes(numels, bucket_elems, stage, units)
    step = n * ALIGN
    return sum(-(-g // step) * step for g in groups)


def placement(stage: int, offload_optimizer: str = "none", offload_param: str = "none") -> dict[str, str]:
    """Where each model-state kind lives: "none" (the compute device), "cpu" (host memory) or "nvme"."""
    # With the optimizer offloaded (cpu or nvme) it steps on the host, where stages 2-3 reduce the fp32 shard.
    host_grads = "cpu" if stage >= 2 and offload_optimizer != "none" else "none"
    return {"params": offload_param, "grads": host_grads, "master_weights": offload_optimizer,
            "optimizer_states": offload_optimizer}


def model_states(rp: "RankParams", dp: int, stage: int, d: int, opt: str, opt_params: dict | None = None,
                 bucket_elems: int = 10_000_000, offload_optimizer: str = "none",
                 offload_param: str = "none", on_cpu: bool = False) -> dict:
    """Bytes by kind (params, grads, master_weights, optimizer_states: what is resident in memory) and
    by place (device, host, disk). `on_cpu`: the compute device is the CPU, so host and device are one."""
    key = ("model_states", dp, stage, d, opt, repr(sorted((opt_params or {}).items())), bucket_elems,
           offload_optimizer, offload_param, on_cpu)
    if key not in rp.memo:
        rp.memo[key] = _model_states(rp, dp, stage, d, opt, opt_params, bucket_elems, offload_optimizer,
                                     offload_param, on_cpu)
    out = rp.memo[key]
    return {**out, "on_disk": dict(out["on_disk"])}     # (a copy: the caller's to change)


def _model_states(rp: "RankParams", dp: int, stage: int, d: int, opt: str, opt_params: dict | None,
                  bucket_elems: int, offload_optimizer: str, offload_param: str, on_cpu: bool) -> dict:
    units = rp.units + ([rp.root] if rp.root else [])
    total = padded(rp.numels, dp, bucket_elems, stage, units)
    shard = total / dp
    opt_elems = total if stage == 0 else shard
    # An fp32 model is its own master copy, unless the optimizer steps somewhere else (another device, disk).
    separate = d < 4 or offload_optimizer == "nvme" or (offload_optimizer == "cpu" and not on_cpu)
    kinds = {"params": total * d / (dp if stage == 3 else 1),
             "grads": total * d if stage <= 1 else shard * 4,
             "master_weights": opt_elems * 4 if separate else 0.0,
             # (Adafactor under ZeRO: each rank keeps the row and column moments of the matrices it has a part
             # of, about 1/N of them)
             "optimizer_states": optimizer_bytes(opt, rp.shapes, opt_params, rp.numels)
             * (opt_elems / max(rp.total, 1))}
    place = placement(stage, offload_optimizer, offload_param)
    host = sum(v for k, v in kinds.items() if place[k] == "cpu")
    disk = sum(v for k, v in kinds.items() if place[k] == "nvme")
    out = {k: (0.0 if place[k] == "nvme" else v) for k, v in kinds.items()}
    out["model_states"] = sum(out.values())
    out["host"], out["disk"] = host, disk
    out["on_disk"] = {k: v for k, v in kinds.items() if place[k] == "nvme"}
    out["device"] = out["model_states"] - host
    return out


def with_frozen_base(states: dict, frozen: int, dp: int, stage: int, d: int) -> dict:
    """`states` (model_states of the LoRA adapters) with the `frozen` base elements held beside them: in the
    model dtype, sharded at ZeRO-3, on the device, with no gradients or optimizer states of their own."""
    if not frozen:
        return states
    held = frozen * d / (dp if stage == 3 else 1)
    return {**states, "params": states["params"] + held, "model_states": states["model_states"] + held,
            "device": states["device"] + held}


# -- transient bytes of the ZeRO stages, beside the resident model states ---------------------------
def grad_shard_elems(states: dict, rp: "RankParams", dp: int, stage: int) -> float:
    """Elements of the fp32 gradient shard the optimizer steps: the padded shard stages 2-3 keep (their
    gradients are fp32), else 1/N of the parameters (ZeRO-1 makes it at the last reduce)."""
    return states["grads"] / 4 if stage >= 2 else rp.total / dp


def zero3_gathered_bytes(rp: "RankParams", d: int, base: "RankParams | None" = None) -> float:
    """ZeRO-3's gathered parameters in backward: the root unit, a block and its prefetch (LoRA: a unit
    gathers its frozen `base` with its adapters)."""
    units = [a + b for a, b in zip(rp.units, base.units)] if base is not None else rp.units
    root = rp.root + (base.root if base is not None else 0)
    return (root + 2 * max(units, default=0)) * d


def gradient_bucket_bytes(rp: "RankParams", dp: int, stage: int, d: int, bucket_elems: int) -> float:
    """Gradient buckets held in backward, beside the activations (stage 0: none beyond the flat buffer)."""
    if stage == 0:
        return 0.0
    if stage == 3:
        # The root unit's staging bucket opens with the head's gradient, first in backward, and closes with the
        # embedding's, last: it and the block being filled are what stand beside the activations.
        return (rp.root + max(rp.units, default=0)) * d
    # The reducer keeps IN_FLIGHT buckets in flight and launches one more before it waits: each has a
    # reduce-scatter output (1/N of it) and, at stage 2, the full staging bucket autograd copied into.
    sizes = sorted(bucket_sizes(rp.numels, bucket_elems, stage))
    live = sum(sizes[-(IN_FLIGHT + 1):])
    return live * d * ((1 if stage == 2 else 0) + 1 / dp)


def nvme_swap_in_bytes(states: dict, shard: float, sub_group_elems: int) -> float:
    """Optimizer on NVMe: one sub-group's fp32 master weights and optimizer states read back into host
    memory for its step (`shard`: grad_shard_elems)."""
    sub = min(sub_group_elems, shard)
    k = states["on_disk"].get("optimizer_states", 0.0) / max(shard, 1)
    return sub * (4 + k)


def zero_paper(psi: float, n: int, k: float = 12, stage: int = 0) -> float:
    """Model-state bytes per rank in the ZeRO paper's accounting: 16-bit parameters and gradients
    (2 bytes each) and K bytes of optimizer state per parameter (12 for mixed-precision Adam: the fp32
    master copy's 4 and Adam's 8)."""
    return model_state_bytes(psi, 2, k - 4, n, stage)["total"]
