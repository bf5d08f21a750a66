"""Training metrics: rank 0's progress bar, JSONL and TensorBoard logs, tokens/s, MFU, and the summary table."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# Dense bf16 peak FLOP/s of common accelerators (no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "A10": 125e12, "V100": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    """The chip's dense bf16 peak, or None when unknown (CPU: MFU is not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def open_history(path: Path, resumed_at: int):
    """metrics.jsonl for writing: fresh for a new run; for a resumed one the history up to the checkpoint's
    step kept (records of steps after it were lost with the crash and come again), the resume marked."""
    if not resumed_at or not path.is_file():
        return open(path, "w")
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue                       # a line cut by the crash
        if not isinstance(step, int) or step <= resumed_at:
            kept.append(line)
    f = open(path, "w")
    f.write("".join(k + "\n" for k in kept) + json.dumps({"time": time.time(), "step": resumed_at,
                                                         "event": "resumed"}) + "\n")
    f.flush()
    return f


class Metrics:
    """Everything rank 0 shows and writes while training; other ranks only time their steps."""

    def __init__(self, out_dir: Path, metrics_file: str, total_steps: int, rank: int, tensorboard=None,
                 console: Console | None = None, resumed_at: int = 0):
        self.rank, self.total = rank, total_steps
        self.console = console or Console(stderr=True)
        self.jsonl = None
        self.tb = None
        self.progress = None
        if rank != 0:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open_history(out_dir / metrics_file, resumed_at)
        if tensorboard is not None and tensorboard.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("tensorboard.enabled is true but the tensorboard package is missing: "
                                   "pip install tensorboard (or set tensorboard.enabled to false)") from e
            path = Path(tensorboard.output_path or out_dir / "tensorboard") / tensorboard.job_name
            self.tb = SummaryWriter(str(path))
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=self.console, disable=not self.console.is_terminal and
                                 os.environ.get("BUNSAN_PROGRESS") != "1")
        self.task = self.progress.add_task("train", total=total_steps, loss="-", tps="-")
        self.progress.start()

    def log(self, record: dict) -> None:
        if self.rank != 0:
            return
        record = {"time": time.time(), **record}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(k, v, record["step"])
        if "loss" in record:
            self.progress.update(self.task, completed=record["step"], loss=f"{record['loss']:.4f}",
                                 tps=f"{record.get('tokens_per_s', 0):,.0f}")
            if self.progress.disable:  # not a terminal (CI, a pipe): plain lines instead of a bar
                self.console.print(f"step {record['step']:>5}/{self.total}  loss {record['loss']:.4f}  "
                                   f"lr {record.get('lr', 0):.2e}  {record.get('tokens_per_s', 0):,.0f} tok/s")

    def close(self) -> None:
        if self.rank != 0:
            return
        self.progress.stop()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()

    def summary(self, first_loss: float, last_loss: float, entropy: float | None, tokens_per_s: float,
                mfu: float | None, memory: list[dict], extra: dict | None = None) -> None:
        """The closing table: loss first -> last, throughput, and per-rank memory as measured."""
        if self.rank != 0:
            return
        t = Table(title="bunsan train: summary")
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("loss first -> last", f"{first_loss:.4f} -> {last_loss:.4f} nats/token")
        if entropy is not None:
            t.add_row("corpus unigram entropy", f"{entropy:.4f} nats/token (a model that learns nothing)")
        t.add_row("throughput", f"{tokens_per_s:,.0f} tokens/s")
        if mfu is not None:
            t.add_row("MFU", f"{100 * mfu:.1f} %")
        for k, v in (extra or {}).items():
            t.add_row(k, str(v))
        self.console.print(t)
        m = Table(title="memory per rank, measured (MiB)")
        cols = {"params": "params", "grads": "grads", "master_weights": "master", "optimizer_states": "optim",
                "model_states": "states", "theory_model_states": "theory", "peak_rss": "peak RSS"}
        if memory and "cuda_peak_allocated" in memory[0]:
            cols["cuda_peak_allocated"] = "CUDA peak"
        m.add_column("rank")
        for c in cols.values():
            m.add_column(c, justify="right")
        for r, rep in enumerate(memory):
            m.add_row(str(r), *[f"{rep.get(c, 0) / 2**20:.1f}" for c in cols])
        self.console.print(m)
        self.console.print("states = params + grads + master + optim as held; theory = the same by formula")
