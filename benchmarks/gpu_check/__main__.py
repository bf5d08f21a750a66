"""`python -m benchmarks.gpu_check [--dry-run] [--out DIR] [--sections a,b]`: run every section, print the table,
write gpu-check.json (and gpu-check.log, every section's output), exit 1 if any row failed.

Each section runs as `python -m benchmarks.gpu_check --section NAME ...` in a process of its own, in a process
group of its own, with a wall-clock deadline: it skips (recorded, with why) the rows that would overrun, and a
section still running at its deadline plus a grace period is killed with everything it started (ranks,
servers), its unfinished rows failed as timed out. So the whole check ends within --time-limit, whatever hangs:
a lent GPU's lease ends hard.

A dry run has no budget: it exists to prove every row's logic runs, and a loaded CPU (the test suite's) may be
slow for any stretch, so a budget would turn load into skips. Its sections run until they end; only a section
still running after DRY_HANG_S (far past any dry run's need) is killed, as hung.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, Row, Section, commit, machine

# name, budget in seconds on the GPU (None: what is left of the time limit), what it checks.
# GPU budgets from the sizes each section runs (see its module); they add up to the 8 minutes the issue allows.
# throughput and kernels take what is left (kernels last: the planner's figures wait for the targets' rows).
SECTIONS = [
    ("single", 45, "world size 1 on the GPU, bf16/fp16, ZeRO 0-3, offload, checkpointing, LoRA vs CPU fp32"),
    ("syncs", 30, "host syncs per step under a one-rank NCCL group, ZeRO 0-3 and offload"),
    ("shared_gpu", 75, "two ranks on one GPU through gloo: DP, ZeRO 1-3, TP, TP+SP, PP, EP, checkpoint"),
    ("inference", 50, "bunsan generate --device-map auto and bunsan serve on the GPU in bf16"),
    ("throughput", None, "1B: tokens/s and MFU, eager and compiled, vs torch's loop; memory vs estimate"),
    ("kernels", None, "GEMMs by shape, flash attention by length, element-wise passes; compiled recompute's memory; "
                      "the MoE block's grouped_mm against its loop"),
]
# The issue: under 8 minutes on the H200, the wheels' install and the table included (a lent GPU's lease is 9).
TIME_LIMIT_S = 460.0
GRACE_S = 15.0                                 # past its deadline a section may still be writing its last row
MIN_SECTION_S = 10.0                           # less than this left: the section is not started
DRY_HANG_S = 900.0                             # a dry run's section still running after this is hung


def _parse(argv):
    ap = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU at tiny sizes (the test suite)")
    ap.add_argument("--out", default=None, help="where gpu-check.json and gpu-check.log go (default: $OUT, else .)")
    ap.add_argument("--sections", default=None, help="comma-separated subset of: " + ", ".join(s[0] for s in SECTIONS))
    ap.add_argument("--time-limit", type=float, default=None, help="seconds for the whole check (default 460; "
                    "a dry run has no limit)")
    ap.add_argument("--section", help=argparse.SUPPRESS)         # internal: run one section in this process
    ap.add_argument("--rows-file", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _run_one(args) -> int:
    """This process is one section: run it, its rows to --rows-file."""
    section = Section(args.section, args.rows_file, args.deadline, args.dry_run)
    module = importlib.import_module(f"benchmarks.gpu_check.{args.section}")    # a wrong name fails before torch
    from .common import set_threads
    set_threads(args.dry_run)
    module.main(section)
    return 0


# -- the parent ---------------------------------------------------------------------------------------------
def _preflight(dry_run: bool) -> Row:
    """What the sections need from this Python: bunsan's imports (pydantic from the carried wheels on the GPU
    machine), serve's (starlette, uvicorn, httpx), peft for LoRA, and a GPU unless this is a dry run."""
    row = Row("preflight", "environment")
    missing = []
    for name in ("torch", "pydantic", "bunsan", "peft", "safetensors", "starlette", "uvicorn", "httpx", "rich"):
        try:
            mod = importlib.import_module(name)
            row.numbers[name] = getattr(mod, "__version__", None) or importlib.metadata.version(name)
        except Exception as e:       # ImportError, or a broken install's own error
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        row.status, row.why = "fail", ("cannot import " + "; ".join(missing) + ". On the GPU machine: run "
                                       "`bash scripts/gpu-wheels` on a machine with PyPI first and carry .whl")
    if not dry_run and "torch" in row.numbers:
        import torch
        if not torch.cuda.is_available():
            row.status, row.why = "fail", (row.why + " " if row.why else "") + \
                "no CUDA device is visible (run on the GPU machine, or pass --dry-run)"
    row.headline = ", ".join(f"{k} {v}" for k, v in row.numbers.items())
    return row


def _tail(path: Path, lines: int = 12) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _section(name: str, deadline: float | None, dry_run: bool, work: Path, log) -> tuple[list[dict], dict]:
    """Run a section's process until it ends or its deadline passes (without one, a dry run's: until it ends or
    hangs); its rows, planned rows it never reported as failed with why."""
    rows_file, out_file = work / f"{name}.rows.jsonl", work / f"{name}.log"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--section", name, "--rows-file", str(rows_file)] + \
        ([] if deadline is None else ["--deadline", f"{deadline:.3f}"]) + (["--dry-run"] if dry_run else [])
    wait_s = DRY_HANG_S if deadline is None else max(1.0, deadline + GRACE_S - time.time())
    start = time.time()
    timed_out = False
    with open(out_file, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        finally:
            try:                     # the section's group: its ranks and servers go with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.time() - start
    killed = "" if not timed_out else " (killed at its deadline)" if deadline is not None else " (killed as hung)"
    log.write(f"\n===== section {name}: rc {rc}, {seconds:.1f} s{killed} =====\n{out_file.read_text(errors='replace')}")
    log.flush()
    plan, rows = [], {}
    if rows_file.exists():
        for line in rows_file.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:      # the last line of a section killed while writing it
                continue
            if "plan" in record:
                plan = record["plan"]
            else:
                rows[record["row"]["name"]] = record["row"]
    if timed_out and deadline is None:
        why = f"the section was still running {seconds:.0f} s after it started (hung) and was killed before this row"
    elif timed_out:
        why = f"the section was killed at its deadline ({seconds:.0f} s after it started) before this row ended"
    elif rc != 0:
        why = f"the section's process exited with rc {rc} before this row: {_tail(out_file)}"
    elif not plan:
        why = "the section ended without a plan of its rows"
    else:
        why = "the section ended without reporting this row"
    for n in plan or ([] if rows else ["(section)"]):
        if n not in rows:
            rows[n] = vars(Row(name, n, status="fail", why=why))
    ordered = [rows[n] for n in plan if n in rows] + [r for n, r in rows.items() if n not in plan]
    return ordered, {"name": name, "rc": rc, "seconds": round(seconds, 1), "timed_out": timed_out,
                     "budget_s": None if deadline is None else round(deadline - start, 1)}


def _deadline(gpu_budget: float | None, end: float, now: float) -> float:
    """A real run's section: its own budget, within what is left of the check's time limit."""
    return end - GRACE_S if gpu_budget is None else min(now + gpu_budget, end - GRACE_S)


def _not_started(name: str, pre: Row, deadline: float | None, now: float, limit: float | None) -> Row | None:
    """The row recorded in place of a section that does not start: the preflight failed (fail), or a real run's
    time limit is spent (skipped). None: start it (a dry run's, with no deadline, always starts)."""
    if pre.status != "pass":
        return Row(name, "(section)", status="fail", why=f"preflight failed: {pre.why}")
    if deadline is not None and deadline - now < MIN_SECTION_S:
        return Row(name, "(section)", status="skipped", why=f"the check's time limit ({limit:.0f} s) is spent")
    return None


def _passed(counts: dict, dry_run: bool) -> bool:
    """No row failed; and in a dry run none was skipped either: a dry run proves every row runs, so a skip there is
    as bad as a failure (on a GPU a row the lease cannot hold is skipped, with why, and the rest stands)."""
    return counts["fail"] == 0 and not (dry_run and counts["skipped"])


def _summary(row: dict) -> str:
    text = row.get("headline") or ""
    if row["status"] != "pass" and row.get("why"):
        text = (text + " | " if text else "") + row["why"]
    return text


def _table(rows: list[dict], title: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for r in rows:
            print(f"{r['section']:<11} {r['name']:<38} {r['status']:<8} {_summary(r)}")
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))
    table = Table(title=title, show_lines=False)
    for col in ("section", "row", "status", "figures / why"):
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "skipped": "yellow"}
    for r in rows:
        table.add_row(r["section"], r["name"], f"[{style[r['status']]}]{r['status']}[/]", _summary(r))
    console.print(table)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.section:
        return _run_one(args)
    if args.dry_run and args.time_limit is not None:
        print("scripts/gpu-check: --time-limit is for a real run; a dry run has no time limit (it runs every row)")
        return 2
    started = time.time()
    limit = None if args.dry_run else (args.time_limit or TIME_LIMIT_S)
    end = None if limit is None else started + limit
    out = Path(args.out or os.environ.get("OUT") or ".").resolve()
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s for s in SECTIONS if args.sections is None or s[0] in args.sections.split(",")]
    unknown = set((args.sections or "").split(",")) - {s[0] for s in SECTIONS} - {""}
    if unknown:
        print(f"scripts/gpu-check: unknown sections {sorted(unknown)}; known: {[s[0] for s in SECTIONS]}")
        return 2
    pre = _preflight(args.dry_run)
    rows, sections = [vars(pre)], []
    print(f"gpu-check{' --dry-run' if args.dry_run else ''}: {len(wanted)} sections "
          f"{'with no time limit' if limit is None else f'in at most {limit:.0f} s'}; preflight {pre.status} {pre.why}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bunsan-gpu-check-") as tmp, open(out / "gpu-check.log", "w") as log:
        for name, gpu_budget, what in wanted:
            now = time.time()
            deadline = None if end is None else _deadline(gpu_budget, end, now)
            instead = _not_started(name, pre, deadline, now, limit)
            if instead is not None:
                rows.append(vars(instead))
                continue
            print(f"section {name}: {what}" + ("" if deadline is None else f" (until +{deadline - started:.0f} s)"),
                  flush=True)
            got, info = _section(name, deadline, args.dry_run, Path(tmp), log)
            rows += got
            sections.append(info)
            bad = [r["name"] for r in got if r["status"] != "pass"]
            print(f"section {name}: {len(got) - len(bad)}/{len(got)} passed in {info['seconds']:.0f} s"
                  + (f"; not passed: {', '.join(bad)}" if bad else ""), flush=True)
    info = machine()
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skipped")}
    ok = _passed(counts, args.dry_run)
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "commit": commit(),
              "machine": info, "dry_run": args.dry_run,
              "command": "scripts/gpu-check " + " ".join(argv or sys.argv[1:]),
              "time_limit_s": limit, "elapsed_s": round(time.time() - started, 1), "passed": ok, "counts": counts,
              "sections": sections, "rows": rows}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    where = "CPU (dry run)" if args.dry_run else (info.get("gpu") or "no GPU")
    _table(rows, f"bunsan GPU self-check{' (dry run)' if args.dry_run else ''} on {where}, torch {info['torch']}, "
                 f"CUDA {info['cuda']}, commit {report['commit'][:12]}: {counts['pass']} passed, {counts['fail']} "
                 f"failed, {counts['skipped']} skipped in {report['elapsed_s']:.0f} s")
    print(f"wrote {out / 'gpu-check.json'} and {out / 'gpu-check.log'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
