"""What every section shares: rows and their verdicts, the section's budget, models, batches and the plain loop.

A section runs in its own process (see __main__.py) and reports rows as JSON lines to a file the parent reads:
first its plan (the names of every row it means to report, so a row lost to a crash or a timeout still shows,
as failed), then each row as it finishes.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import platform
import subprocess
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class RowFailed(Exception):
    """A row's verdict: failed, with why."""


def check(ok: bool, why: str) -> None:
    if not ok:
        raise RowFailed(why)


@dataclass
class Row:
    section: str
    name: str
    status: str = "pass"              # pass | fail | skipped
    headline: str = ""               # the row's figures in a few words, for the table
    numbers: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    why: str = ""                     # the failure or the skip, in words
    seconds: float = 0.0

    def note(self, text: str) -> None:
        self.notes.append(text)


# A dry run has no budget (a loaded CPU may take any time to run every row, and a skipped row proves nothing):
# waits that would end at the section's deadline on a GPU end at this ceiling instead, which only catches a hang.
DRY_WAIT_S = 300.0


class Section:
    """One section's rows, its deadline (wall clock, set by the parent; None in a dry run) and the file its rows
    go to."""

    def __init__(self, name: str, rows_file: str, deadline: float | None, dry_run: bool):
        self.name, self.rows_file, self.deadline, self.dry_run = name, rows_file, deadline, dry_run
        self.rows: dict[str, Row] = {}

    def left(self) -> float:
        """Seconds until the deadline; without one (a dry run), the ceiling of a wait that only catches hangs."""
        return DRY_WAIT_S if self.deadline is None else self.deadline - time.time()

    def _write(self, record: dict) -> None:
        with open(self.rows_file, "a") as f:          # a line at a time: what was written survives a kill
            f.write(json.dumps(record, default=str) + "\n")

    def plan(self, names: list[str]) -> None:
        self._write({"plan": list(names)})

    def skip(self, name: str, why: str) -> Row:
        row = Row(self.name, name, status="skipped", why=why)
        self.emit(row)
        return row

    def emit(self, row: Row) -> None:
        self.rows[row.name] = row
        self._write({"row": asdict(row)})
        mark = {"pass": "ok", "fail": "FAIL", "skipped": "skip"}[row.status]
        print(f"[{self.name}] {row.name}: {mark} ({row.seconds:.1f}s) {row.why}", flush=True)

    def run(self, name: str, fn, need_s: float = 0.0, *args) -> Row:
        """Run `fn(row, *args)` as row `name`, unless the section has a deadline and less than `need_s` of it is
        left (then skipped). A RowFailed or any exception fails the row with its message; the section goes on."""
        if self.deadline is not None and self.left() < need_s:
            return self.skip(name, f"{self.left():.0f} s left of the section's budget; this row needs about "
                                   f"{need_s:.0f} s")
        row, start = Row(self.name, name), time.perf_counter()
        try:
            fn(row, *args)
        except RowFailed as e:
            row.status, row.why = "fail", str(e)
        except Exception as e:       # an error in bunsan (or torch) is this row's failure, not the run's
            row.status, row.why = "fail", f"{type(e).__name__}: {e}"[:2000]
            row.note("traceback: " + " | ".join(traceback.format_exc().strip().splitlines()[-12:]))
        row.seconds = time.perf_counter() - start
        self.emit(row)
        return row


# -- sizes and devices --------------------------------------------------------------------------------
@dataclass
class Sizes:
    """Model and batch of the correctness rows: small enough to be quick, big enough to be real on a GPU."""
    preset: str
    seq: int
    rows: int                # global batch (samples per optimizer step)
    steps: int
    model: dict = field(default_factory=dict)    # the preset's fields changed


GPU_SIZES = Sizes("small", 128, 8, 4)
# A dry run proves the rows' logic, not figures: the smallest model every layout splits (2 layers for PP 2; 4 query
# and 2 KV heads for TP 2), 4 rows (2 ranks x 2 micro-batches), and 3 steps: a parity row needs the reference's
# loss to move past its tolerance (3e-2 in 16 bits), which one update of this model does not do reliably.
DRY_SIZES = Sizes("tiny", 16, 4, 3, model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2))


def sizes(dry_run: bool) -> Sizes:
    return DRY_SIZES if dry_run else GPU_SIZES


def device(dry_run: bool):
    """The GPU, or the CPU in a dry run. A real run without CUDA is refused: it would prove nothing."""
    import torch
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible: run on the GPU machine, or pass --dry-run")
    return torch.device("cuda", 0)


def begin(section: Section, rows) -> tuple:
    """A section's start: it announces its rows; (the sizes of its correctness rows, its device, the seeded
    batches of those rows)."""
    section.plan(list(rows))
    sz = sizes(section.dry_run)
    return sz, device(section.dry_run), token_batches(sz.steps, sz.rows, sz.seq)


def set_threads(dry_run: bool) -> None:
    """A section's process set up: in a dry run at most two threads, and torch.compile's default backend
    aot_eager (dynamo's capture and AOT autograd's graphs, as on the GPU, without inductor's C++ code generation,
    which takes minutes on a CPU and proves nothing about the check)."""
    import torch
    if dry_run:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        compile_ = torch.compile

        def dry_compile(model=None, **kwargs):
            kwargs.setdefault("backend", "aot_eager")
            return compile_(**kwargs) if model is None else compile_(model, **kwargs)
        torch.compile = dry_compile


def free_memory() -> None:
    """Drop what earlier rows left (engines hold reference cycles) so the next one starts clean."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- models and data ------------------------------------------------------------------------------------
def llama_config(preset: str, **overrides):
    from bunsan.models import get_preset
    return get_preset(preset).replace(**overrides)


def build_model(preset: str, seed: int = 0, **overrides):
    """A bunsan Llama drawn on the CPU from `seed`: every copy of it (GPU, CPU, each rank) starts equal."""
    import torch
    from bunsan.models import Llama
    torch.manual_seed(seed)
    return Llama(llama_config(preset, **overrides))


def clone(model):
    return copy.deepcopy(model)


def token_batches(steps: int, rows: int, seq: int, tokens: int = 16, seed: int = 1) -> list[dict]:
    """Seeded synthetic batches a model learns within a few steps, so that a broken step shows in the loss (on
    uniform random bytes the loss barely moves from ln(256) and any step would match): only `tokens` of the
    model's 256 ids occur (the loss falls towards ln(tokens) as the model learns which), and each next one is
    (5 x token + 7) mod tokens, one in ten replaced by a random one. int64 {input_ids, labels}; labels are
    already shifted (labels[t] is the target of position t), as bunsan's engine takes them."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.empty(rows, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, tokens, (rows,), generator=g)
        for t in range(1, seq + 1):
            ids[:, t] = (5 * ids[:, t - 1] + 7) % tokens
            noise = torch.rand(rows, generator=g) < 0.1
            ids[noise, t] = torch.randint(0, tokens, (int(noise.sum()),), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def lm_loss(logits, labels):
    """bunsan's loss: token cross-entropy in fp32, mean over the batch's tokens."""
    import torch.nn.functional as F
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def reference_losses(model, data: list[dict], make_optimizer, dev, skip: list[bool] | None = None) -> list[float]:
    """The plain single-process loop every layout is checked against: the whole global batch per step, fp32,
    no clipping. `skip[i]`: step i's update is not applied (bunsan's fp16 scaler skipped it on overflow)."""
    import torch
    model = model.to(dev, dtype=torch.float32)
    opt = make_optimizer(model.parameters())
    losses = []
    for i, batch in enumerate(data):
        loss = lm_loss(model(batch["input_ids"].to(dev)), batch["labels"].to(dev))
        loss.backward()
        if not (skip and skip[i]):
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compare_losses(row: Row, got: list[float], want: list[float], rtol: float, against: str) -> None:
    """Verdict of a parity row: same number of steps, all finite, every loss within rtol of the reference,
    and the reference itself moved by more than the tolerance (else equal losses would prove nothing)."""
    row.numbers.update(losses=[round(x, 6) for x in got], reference=[round(x, 6) for x in want], rtol=rtol)
    check(len(got) == len(want), f"{len(got)} losses for {len(want)} reference steps")
    check(all(math.isfinite(x) for x in got), f"non-finite loss: {got}")
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)]
    row.numbers["max_rel_diff"] = float(f"{max(rel):.3g}")
    moved = abs(want[-1] - want[0]) / abs(want[0])
    row.numbers["reference_moved"] = float(f"{moved:.3g}")
    worst = max(range(len(rel)), key=rel.__getitem__)
    row.headline = f"max rel diff {max(rel):.1e} vs {against} (rtol {rtol:g}); loss {want[0]:.3f} -> {got[-1]:.3f}"
    check(max(rel) <= rtol, f"step {worst + 1}: loss {got[worst]:.6f} vs {against} {want[worst]:.6f} "
                            f"(rel diff {rel[worst]:.2e} > rtol {rtol:g})")
    check(moved > rtol, f"the reference loss moved by only {moved:.2e} over {len(want)} steps, within rtol "
                        f"{rtol:g}: the comparison could not tell a step from no step")


# -- where things come from ----------------------------------------------------------------------------------
def stack():
    """The caller's Python stack, outermost first, without reading source lines (cheap enough per host read)."""
    frames = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
    frames.reverse()
    return frames


def where(stack) -> str:
    """The innermost frame of a stack that is bunsan's (else the check's, else the innermost outside torch and
    the standard library): the line to look at for a host sync."""
    frames = [f for f in stack if "warnings.py" not in f.filename and "gpu_check/syncs.py" not in f.filename]
    for pick in (lambda f: "/bunsan/" in f.filename, lambda f: "/benchmarks/" in f.filename,
                 lambda f: "/torch/" not in f.filename and "/lib/python" not in f.filename):
        hits = [f for f in frames if pick(f)]
        if hits:
            f = hits[-1]
            return f"{os.path.relpath(f.filename, REPO) if f.filename.startswith(str(REPO)) else f.filename}" \
                   f":{f.lineno} {f.name}"
    f = frames[-1] if frames else None
    return f"{f.filename}:{f.lineno} {f.name}" if f else "?"


# -- the machine ----------------------------------------------------------------------------------------
def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def machine() -> dict:
    import torch
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpus": os.cpu_count(), "gpu": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=p.total_memory,
                    gpu_capability=f"{p.major}.{p.minor}", gpu_count=torch.cuda.device_count())
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    return info
