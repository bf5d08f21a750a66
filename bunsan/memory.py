"""Memory: what the model states should take (theory) and what they do take (measured), side by side.

Theory follows the ZeRO paper's accounting of model states per data-parallel rank
(Ψ parameters, K optimizer bytes per parameter): parameters and gradients in the
model dtype, fp32 master weights when the model is 16-bit, plus the optimizer's
own state. Measured figures are the bytes of the tensors the engine really holds,
plus the process's peak resident set (CPU) or CUDA peak allocation.
"""

from __future__ import annotations

import math
import resource

import torch


def optimizer_state_bytes_per_param(opt_type: str, params: dict | None = None) -> float:
    """K without master weights: fp32 state bytes per parameter of torch's optimizers (dense estimate)."""
    t = opt_type.lower()
    params = params or {}
    if t in ("adamw", "adam"):
        return 12.0 if params.get("amsgrad") else 8.0
    if t == "sgd":
        return 4.0 if params.get("momentum", 0) else 0.0
    return 0.0  # Adafactor: factored, depends on shapes -> see adafactor_state_bytes


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


def model_state_bytes(psi: int, dtype_bytes: int, opt_bytes_per_param: float, dp: int = 1, stage: int = 0) -> dict:
    """Predicted model-state bytes per rank for ZeRO stage `stage` over `dp` ranks."""
    master = 4 if dtype_bytes < 4 else 0
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[stage]
    out = {"params": psi * dtype_bytes / shard[0], "grads": psi * dtype_bytes / shard[1],
           "master_weights": psi * master / shard[2], "optimizer_states": psi * opt_bytes_per_param / shard[2]}
    out["total"] = out["params"] + out["grads"] + out["master_weights"] + out["optimizer_states"]
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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


def measured_memory(engine) -> dict:
    """Bytes this rank holds, by kind, next to the theory for the same layout."""
    flat = engine.flat
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    opt_tensors = [v for s in engine.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.numel() > 1]
    report = {
        "params": flat.data.numel() * flat.data.element_size() + _tensor_bytes(frozen),
        "grads": flat.grad.numel() * flat.grad.element_size(),
        "master_weights": engine.master.numel() * 4 if engine.master is not None else 0,
        "optimizer_states": _tensor_bytes(opt_tensors),
        "buffers": _tensor_bytes(engine.module.buffers()),
    }
    report["model_states"] = sum(report[k] for k in ("params", "grads", "master_weights", "optimizer_states"))
    opt_k = optimizer_state_bytes_per_param(type(engine.optimizer).__name__, engine.optimizer.defaults)
    theory = model_state_bytes(flat.numel, flat.data.element_size(), opt_k, engine.mesh.dp,
                               engine.cfg.zero_optimization.stage)
    if type(engine.optimizer).__name__.lower() == "adafactor":
        theory["optimizer_states"] = adafactor_state_bytes([p.shape for p in flat.params])
        theory["total"] = theory["params"] + theory["grads"] + theory["master_weights"] + theory["optimizer_states"]
    report["theory_model_states"] = int(theory["total"])
    report["peak_rss"] = peak_rss_bytes()
    report["rss"] = current_rss_bytes()
    if engine.device.type == "cuda":
        report["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(engine.device)
        report["cuda_allocated"] = torch.cuda.memory_allocated(engine.device)
    return report
