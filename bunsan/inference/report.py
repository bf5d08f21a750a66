"""Predicted against measured memory, per device, of a model loaded by `bunsan.inference.load` after it generated.

Predicted (bunsan.estimator.inference): a device holds its blocks' weights, its layers' KV caches and one
step's activations (plus the prompt's logits where the head is). The CPU also holds the KV caches of the
layers on disk and the disk block being read in. The rotary tables sit beside the embedding (on the CPU when it
is on disk). "disk" is what is read per step.

Measured: torch.cuda.max_memory_allocated for a GPU; for the CPU the growth of the process's peak resident
set from `start()` (Linux's high-water mark, reset there); for disk the bytes the disk blocks' hooks read,
per step.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from bunsan.estimator.inference import InferenceMemory
from bunsan.memory.measure import current_rss_bytes, peak_rss_bytes, reset_peak_memory
from bunsan.inference.load import placed
from bunsan.inference.placement import human


def start(max_memory: dict | None) -> int:
    """Reset the peaks about to be measured; returns the resident set now (the CPU's baseline)."""
    gpus = [d for d in max_memory or {} if isinstance(d, int)]
    if gpus and torch.cuda.is_available():
        torch.cuda.init()        # the caching allocator's statistics exist only once CUDA is initialized
        for d in gpus:
            torch.cuda.reset_peak_memory_stats(d)
    reset_peak_memory()
    return current_rss_bytes()


def mapped_bytes(directory) -> int:
    """Resident bytes of this process mapped from files under `directory` (safetensors reads by mmap: weights
    of the file's dtype stay pages of the file, which the kernel may drop and read back)."""
    root, total, inside = str(Path(directory).resolve()), 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = line.rstrip().split(maxsplit=5)[-1].startswith(root + "/")
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def _names(names: list[str]) -> str:
    """embed_tokens, layers.0-5, norm: consecutive layers folded into a range."""
    out, run = [], []
    for n in names + [""]:
        if n.startswith("layers.") and (not run or int(n[7:]) == run[-1] + 1):
            run.append(int(n[7:]))
            continue
        if run:
            out.append(f"layers.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else ""))
        run = [int(n[7:])] if n.startswith("layers.") else []
        if n and not run:
            out.append(n)
    return ", ".join(out)


def predicted(est: InferenceMemory, dmap: dict, tied: bool) -> dict:
    """{device: {part: bytes, ..., "total": bytes}}; for "disk", {"read per step": bytes, "total": bytes}."""
    on = {}
    for n, d in dmap.items():
        on.setdefault(d, []).append(n)
    out = {d: est.device_bytes(names) for d, names in on.items() if d not in ("cpu", "disk")}
    host, disk = on.get("cpu", []), on.get("disk", [])
    if host or disk:              # the CPU runs its blocks and the disk ones
        cpu = {"weights": sum(est.weights[n] for n in host),
               "kv_cache": sum(est.kv_cache.get(n, 0) for n in host + disk),
               "activations": est.step + (est.logits if "lm_head" in host + disk else 0),
               "disk block read in": max((est.weights[n] for n in disk), default=0)}
        cpu["total"] = sum(cpu.values())
        out["cpu"] = cpu
    first = dmap["embed_tokens"] if dmap["embed_tokens"] not in ("cpu", "disk") else "cpu"
    out[first]["rotary tables"] = est.rope      # where load() keeps them: where the model starts
    out[first]["total"] += est.rope
    if disk:   # a tied head on disk is read again, apart from the embedding
        read = sum(est.weights[n] for n in disk) + (est.weights["embed_tokens"] if tied and "lm_head" in disk else 0)
        out["disk"] = {"read per step": read, "total": read}
    return out


def lines(model, dmap: dict, baseline: int, checkpoint) -> list[str]:
    """One line per device: its blocks, the predicted bytes by part, the measured bytes and their ratio."""
    est: InferenceMemory = placed(model).memory_estimate
    pred = predicted(est, dmap, model.config.tie_word_embeddings)
    out = [f"memory per device, predicted for batch {est.batch}, {est.prompt_len}-token prompt, "
           f"{est.max_seq} tokens in all, against measured after generating:"]
    for device in sorted(pred, key=lambda d: (not isinstance(d, int), str(d))):
        names = [n for n, d in dmap.items() if d == device]
        parts = " + ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in pred[device].items() if k != "total" and v)
        head = f"{device}: {_names(names) or 'no blocks'} ({len(names)} blocks); predicted {human(pred[device]['total'])}"
        head += f" = {parts}" if device != "disk" else " read per step"
        if device == "cpu":
            measured = peak_rss_bytes() - baseline
            how = (f"peak resident set growth, {human(mapped_bytes(checkpoint))} of it pages mapped from the "
                   "checkpoint's files")
        elif device == "disk":
            reads = placed(model).disk_reads.values()
            steps = max((c for c, _ in reads), default=0)
            measured = sum(b for _, b in reads) // max(steps, 1)
            how = f"read per step, {steps} steps"
        elif torch.cuda.is_available():
            measured, how = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
        else:
            out.append(head)
            continue
        ratio = measured / pred[device]["total"] if pred[device]["total"] else float("nan")
        out.append(f"{head}; measured {human(measured)} ({how}), {ratio:.2f}x predicted")
    return out
