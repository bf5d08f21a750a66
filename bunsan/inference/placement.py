"""Where each block of a model goes for inference: devices in order, then CPU, then disk. A pure function.

Blocks are placed whole (a transformer block is never split); blocks that share a tied weight (a Llama's
embedding and head) go to one device together; each device keeps `headroom` bytes free for activations
and the KV cache. Strategies, as in Accelerate's `device_map`:

    sequential  fill device 0, then device 1, ...
    balanced    give every device about the same share of the model (capacity permitting)
    auto        balanced

What does not fit on the devices goes to "cpu" (if it has a budget), then to "disk" (always there).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024 ** 3


def human(n: float) -> str:
    """Bytes as GiB, MiB or KiB, three significant figures or so."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if abs(n) < 100 * size else f"{n / size:.0f} {unit}"
    return f"{n / 1024:.3g} KiB" if abs(n) >= 1024 else f"{n:.0f} B"


@dataclass(frozen=True)
class Block:
    name: str
    bytes: int
    tied: str | None = None        # blocks with the same tag must share a device


def _units(blocks: list[Block]) -> list[list[Block]]:
    """Blocks in order, tied ones merged into the unit of the first of them."""
    units, where = [], {}
    for b in blocks:
        if b.tied is not None and b.tied in where:
            units[where[b.tied]].append(b)
            continue
        if b.tied is not None:
            where[b.tied] = len(units)
        units.append([b])
    return units


def place(blocks: list[Block], max_memory: dict, strategy: str = "auto", headroom: dict | None = None) -> dict:
    """{block name: device} for `blocks` (in model order) over `max_memory` ({device: bytes}; integer keys are
    accelerators in order, plus optional "cpu"); `headroom` ({device: bytes}) is kept free on each."""
    if strategy not in ("auto", "balanced", "sequential"):
        raise ValueError(f"device_map {strategy!r} is not a strategy; use 'auto', 'balanced', 'sequential' or a "
                         "dict of block name -> device")
    bad = [k for k in max_memory if not (isinstance(k, int) and k >= 0) and k not in ("cpu", "disk")]
    if bad:
        raise ValueError(f"max_memory keys must be device indices (0, 1, ...), 'cpu' or 'disk'; got {bad}")
    headroom = headroom or {}
    devices = sorted(k for k in max_memory if isinstance(k, int))
    free = {d: int(max_memory[d]) - int(headroom.get(d, 0)) for d in devices}
    for d, f in free.items():
        if f < 0:
            raise ValueError(f"device {d}: max_memory {max_memory[d] / GiB:.2f} GiB is smaller than the "
                             f"{headroom[d] / GiB:.2f} GiB kept for activations and the KV cache; give it more")
    units = _units(blocks)
    sizes = [sum(b.bytes for b in u) for u in units]
    total = sum(sizes)
    if strategy != "sequential" and devices:
        # balanced: each device aims at an equal share of what the devices can hold, never above its capacity
        share = min(total, sum(max(f, 0) for f in free.values())) / len(devices)
        target = {d: min(free[d], share) for d in devices}
        target[devices[-1]] = free[devices[-1]]   # the last device takes what is left, up to its capacity
    else:
        target = dict(free)
    cpu_free = int(max_memory["cpu"]) - int(headroom.get("cpu", 0)) if "cpu" in max_memory else 0
    out, k = {}, 0
    used = {d: 0 for d in devices}
    for unit, size in zip(units, sizes):
        while k < len(devices) and used[devices[k]] + size > target[devices[k]]:
            # move on when this device reached its share; a unit bigger than a share may still fit whole
            if used[devices[k]] == 0 and size <= free[devices[k]]:
                break
            k += 1
        if k < len(devices):
            dev = devices[k]
            used[dev] += size
        elif size <= cpu_free:
            dev, cpu_free = "cpu", cpu_free - size
        else:
            dev = "disk"
        for b in unit:
            out[b.name] = dev
    return out


def summary(blocks: list[Block], device_map: dict) -> dict:
    """Bytes placed on each device."""
    out: dict = {}
    for b in blocks:
        out[device_map[b.name]] = out.get(device_map[b.name], 0) + b.bytes
    return out
