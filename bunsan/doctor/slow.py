"""Slow synchronisation: how much of the step a rank spent blocked on communication, and what to change.

Comm times every wait on a collective or a message (comm.wait_s): the part of communication that backward
did not hide. On gloo the host blocks, and the host clock times it; on NCCL the compute stream waits, and CUDA
events on it time that (comm_stats.WaitClock). Past `train.comm_warn_share` of the step time the summary says so and suggests what moves
it: bigger buckets (fewer, larger collectives), overlapping reduction with backward, a lower ZeRO stage
(less traffic), or the layout `bunsan plan` ranks first for these processes.
"""

from __future__ import annotations

import torch


def better_layout(model_config, cfg, world: int, device_type: str) -> str | None:
    """The layout `bunsan plan` ranks first for these processes, when it is not the one running."""
    try:
        from bunsan.estimator.layout import Layout
        from bunsan.planner.search import plan
        from bunsan.doctor.oom import layout_changes, capacity
        current = Layout.from_config(cfg, world)
        memory, _ = capacity(torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu"))
        p = plan(model_config, gpus=world, gpu_memory=memory, gpu="cpu" if device_type == "cpu" else "h100",
                 seq_len=current.seq_len, global_batch=current.global_batch, precision=current.precision,
                 optimizer=current.optimizer, device_type=device_type, keep=1)
    except Exception:      # advice, not a failure: fall back to naming the command
        return None
    if not p.ranked or p.ranked[0].layout == current:
        return None
    best = p.ranked[0]
    return f"bunsan plan ranks first: {best.layout.describe()} ({layout_changes(current, best.layout)})"


def comm_advice(cfg, wait_s: float, elapsed_s: float, world: int, model_config=None,
                device_type: str = "cpu") -> tuple[float, str | None]:
    """(share of the step spent waiting, advice when it is above train.comm_warn_share, else None)."""
    share = wait_s / elapsed_s if elapsed_s > 0 else 0.0
    if world < 2 or share <= cfg.train.comm_warn_share:
        return share, None
    z = cfg.zero_optimization
    tips = [f"raise zero_optimization.reduce_bucket_size (now {int(z.reduce_bucket_size):,} elements: fewer, "
            "larger collectives)"]
    if not z.overlap_comm:
        tips.append("set zero_optimization.overlap_comm true (reduce while backward runs)")
    if z.stage == 3:
        tips.append("use ZeRO stage 2 if it fits (stage 3 gathers every parameter twice a step)")
    elif z.stage >= 1 and cfg.tensor_parallel.size == 1:
        tips.append(f"a lower ZeRO stage moves fewer bytes if memory allows (now {z.stage})")
    better = better_layout(model_config, cfg, world, device_type) if model_config is not None else None
    model = getattr(cfg.model, "preset", None) or "MODEL"
    tips.append(better or f"compare layouts: bunsan plan --model {model} --gpus {world}")
    return share, (f"{share:.0%} of the step time was spent waiting for communication (threshold "
                   f"{cfg.train.comm_warn_share:.0%}, train.comm_warn_share); " + "; ".join(tips))
