"""Memory measured: the bytes of the tensors a rank holds, next to the theory (theory.py) for its layout.

Theory follows the ZeRO paper's accounting of model states per data-parallel rank
(Ψ parameters, K optimizer bytes per parameter): parameters and gradients in the
model dtype, fp32 master weights when the model is 16-bit, plus the optimizer's
own state. Measured figures are the bytes of the tensors the engine really holds,
plus the process's peak resident set (CPU) or CUDA peak allocation.
"""

from __future__ import annotations

import resource

import torch

from bunsan.memory.theory import adafactor_state_bytes, model_state_bytes, optimizer_state_bytes_per_param


def reset_peak_memory(device: torch.device | None = None) -> None:
    """Start a new peak: CUDA's allocator statistics, and on CPU the kernel's high-water mark of the
    resident set (/proc/self/clear_refs "5", Linux >= 4.0; VmHWM then reports the peak since)."""
    if device is not None and device.type == "cuda":
        torch.cuda.init()        # before CUDA's first use the allocator has no statistics to reset
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak stays the lifetime peak


def peak_rss_bytes() -> int:
    """The resident set's high-water mark since the last reset_peak_memory. Read from VmHWM, not getrusage:
    Linux carries ru_maxrss across exec, so a spawned worker's would start at its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024        # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the lifetime peak (KiB)


def host_available_bytes() -> int:
    """The host memory the kernel says is available for new allocations (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _theory_bytes(dp) -> float:
    """The ZeRO formulas' model-state bytes of one strategy's trained parameters over its group."""
    opt_name, defaults, ranks = dp.opt_class.__name__, dp.opt_defaults, dp.group.size
    psi = sum(dp.layout.numels)   # ZeRO-3 parameters are empty between gathers: count from the layout
    theory = model_state_bytes(psi, dp.dtype.itemsize, optimizer_state_bytes_per_param(opt_name, defaults),
                               ranks, dp.stage, grad_shard_bytes=4)
    if opt_name.lower() == "adafactor":
        # row and column moments of each matrix, held by the rank(s) with a part of it under ZeRO (~1/N each)
        theory["optimizer_states"] = adafactor_state_bytes([p.shape for p in dp.params]) / (ranks if dp.stage else 1)
        theory["total"] = theory["params"] + theory["grads"] + theory["master_weights"] + theory["optimizer_states"]
    return theory["total"]


def measured_memory(engine) -> dict:
    """Bytes this rank holds, by kind and by place (device / host / disk), next to the theory for its layout."""
    dp = engine.strategy   # (the data-parallel strategy)
    report = dict(dp.bytes_by_kind())
    report.setdefault("host", 0)
    report.setdefault("disk", 0)
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    sharded = dp.frozen_shards is not None      # ZeRO-3 shards frozen weights too (bytes_by_kind)
    frozen_bytes = _tensor_bytes(frozen)
    if not sharded:
        report["params"] += frozen_bytes
    report["buffers"] = _tensor_bytes(engine.module.buffers())
    report["model_states"] = sum(report[k] for k in ("params", "grads", "master_weights", "optimizer_states"))
    report["device"] = report["model_states"] - report["host"]   # what stays on the compute device
    # expert parallelism: the dense weights' strategy and the experts' (zero/experts.py), each over its group
    theory = sum(_theory_bytes(part) for part in getattr(dp, "parts", (dp,)))
    report["theory_model_states"] = int(theory + frozen_bytes / (engine.mesh.grad_group.size if sharded else 1))
    report["peak_rss"] = peak_rss_bytes()
    report["rss"] = current_rss_bytes()
    if engine.device.type == "cuda":      # peaks since the start of the last optimizer step (the engine resets)
        report["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(engine.device)
        report["cuda_allocated"] = torch.cuda.memory_allocated(engine.device)
        report["cuda_peak_reserved"] = torch.cuda.max_memory_reserved(engine.device)
        report["cuda_reserved"] = torch.cuda.memory_reserved(engine.device)
    return report
