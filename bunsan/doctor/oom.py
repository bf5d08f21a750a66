"""Out of memory at a step: where it happened, what this rank held then, what the estimator predicts for the
layout, and the planner's three fastest layouts that would fit the same memory.

The engine catches the allocator's failure (CUDA out of memory, or a host allocation the OS refused) around
each step and raises OutOfMemory with this explanation; `bunsan train` prints it and exits with EXIT_CODE.
"""

from __future__ import annotations

import gc
import os
import resource

import torch

from bunsan.memory.measure import host_available_bytes

EXIT_CODE = 3
GiB = 1024 ** 3


class OutOfMemory(RuntimeError):
    """A step ran out of memory; the message says where, what was held, what was predicted and what would fit."""


def is_oom(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg
                                            or "not enough memory" in msg)


def capacity(device: torch.device) -> tuple[float, str]:
    """(bytes one rank may use, where that figure comes from)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), "the GPU's memory"
    for limit, name in ((resource.RLIMIT_DATA, "RLIMIT_DATA"), (resource.RLIMIT_AS, "RLIMIT_AS")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            return float(soft), f"this process's {name} limit"
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return float(host_available_bytes()) / ranks, "available host memory / ranks"
    except (OSError, StopIteration):
        return float("nan"), "unknown"


def _gb(x: float) -> str:
    return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / 2**20:.1f} MiB"


def layout_changes(old, new) -> str:
    names = ("dp", "tp", "pp", "zero", "micro_batch", "grad_accum", "checkpointing", "sequence_parallel",
             "offload_optimizer", "offload_param", "precision", "schedule")
    diff = [f"{n} {getattr(old, n)} -> {getattr(new, n)}" for n in names if getattr(old, n) != getattr(new, n)]
    return ", ".join(diff) or "the same layout (it fits with the estimator's margin: the run held more than it)"


def explain(engine, phase: str, seq_len: int | None, exc: BaseException) -> str:
    """The doctor's message for an out-of-memory failure of `engine` in `phase`."""
    gc.collect()
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    rank, world = engine.mesh.rank, engine.mesh.world.size
    cap, source = capacity(engine.device)
    lines = [f"rank {rank}: out of memory at step {engine.global_step + 1}, {phase} ({type(exc).__name__}: "
             f"{str(exc).splitlines()[0][:200]})"]
    try:
        mem = engine.memory_report()
        held = (f"params {_gb(mem['params'])}, grads {_gb(mem['grads'])}, master weights "
                f"{_gb(mem['master_weights'])}, optimizer states {_gb(mem['optimizer_states'])}")
        peak = mem.get("cuda_peak_allocated", mem.get("peak_rss", 0))
        lines.append(f"  held then: {held}; peak {'allocated' if 'cuda_peak_allocated' in mem else 'resident'} "
                     f"{_gb(peak)}; capacity {_gb(cap)} ({source})")
    except Exception as e:       # the report itself needs a little memory
        lines.append(f"  (memory report unavailable: {e})")
    config = getattr(engine.module, "config", None)
    if config is None or not hasattr(config, "num_key_value_heads"):
        lines.append("  the estimator and planner know bunsan's Llama only; try a higher zero_optimization.stage, "
                     "activation_checkpointing, a smaller micro-batch with more accumulation, or offload")
        return "\n".join(lines)
    try:
        from bunsan.estimator import estimate_layout
        from bunsan.estimator.layout import Layout
        from bunsan.planner.search import plan
        cfg = engine.cfg
        current = Layout.from_config(cfg, world).replace(loss_fn=engine.loss_fn is not None)
        if seq_len:                       # what the failing batch had, whatever the config says
            current = current.replace(seq_len=seq_len)
        est = estimate_layout(config, current, device_type=engine.device.type,
                              zero=cfg.zero_optimization.model_dump(), optimizer_params=cfg.optimizer.params,
                              lora=cfg.lora)
        lines.append(f"  predicted for this layout ({current.describe()}): peak {_gb(est.peak)}, model states "
                     f"{_gb(est.model_states['model_states'])}")
        gpu = "cpu" if engine.device.type == "cpu" else "h100"
        p = plan(config, gpus=world, gpu_memory=cap, gpu=gpu, seq_len=current.seq_len,
                 global_batch=current.global_batch, precision=current.precision, optimizer=current.optimizer,
                 device_type=engine.device.type, keep=3)
        if p.ranked:
            lines.append(f"  layouts that fit {_gb(cap)} per rank, fastest first (bunsan plan):")
            for c in p.ranked:
                lines.append(f"    - {layout_changes(current, c.layout)} (peak {_gb(c.peak)})")
        else:
            lines.append("  no layout of these processes fits; " + "; ".join(p.suggestions[:3]))
    except Exception as e:
        lines.append(f"  (estimate and plan unavailable: {type(e).__name__}: {e})")
    return "\n".join(lines)
