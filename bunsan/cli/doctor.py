"""`bunsan doctor`: check this machine and a config before a long run (bunsan/doctor/checks.py)."""

from __future__ import annotations

import os

from bunsan.cli.launch import under_torchrun


def add_parser(sub) -> None:
    d = sub.add_parser("doctor", help="check versions, devices, ranks, disk and a config before a long run")
    d.add_argument("config", nargs="?", help="config file to check against the estimate (default: the main job)")
    d.add_argument("--model", help="model preset / config.json / HF dir (default: the config's model.preset)")
    d.add_argument("--nproc", type=int, default=2, help="local processes to start for the rank check (default 2)")
    d.add_argument("--checkpoint-dir", help="where checkpoints will go (default: the config's checkpoint.dir, or .)")
    d.add_argument("--timeout", type=float, default=30.0, help="seconds the rank check may take")


def cmd_doctor(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from bunsan.config.root import Config
    from bunsan.doctor import checks
    from bunsan.training.loop import MAIN_JOB
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be at least 1")
    cfg = Config.load(args.config if args.config else MAIN_JOB)
    launched = under_torchrun()
    if launched:      # the launcher's ranks are the ones to check; rank 0 reports
        world = checks.launched_world(args.timeout)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        args.nproc = int(os.environ.get("WORLD_SIZE", "1"))
    else:
        world = checks.ranks(args.nproc, args.timeout) if args.nproc > 1 else []
    found = checks.versions() + checks.devices() + world
    device = "cuda" if any(c.name.startswith("gpu") for c in found) else "cpu"
    ckpt_bytes = None
    try:
        check, ckpt_bytes = checks.config(args.model or cfg.model.preset, cfg, args.nproc, device)
        found.append(check)
    except (ValueError, FileNotFoundError) as e:
        found.append(checks.Check("config", "fail", str(e)))
    found.append(checks.disk(args.checkpoint_dir or cfg.checkpoint.dir or ".", ckpt_bytes))
    table = Table(title="bunsan doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for c in found:
        table.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    Console(width=160).print(table)
    return 1 if any(c.status == "fail" for c in found) else 0
