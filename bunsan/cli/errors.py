"""Errors a user can act on, printed once, as bunsan's message; a traceback only for bugs.

Under `bunsan train --nproc N` (launch.relaunch) every failing rank writes its message into a folder the
launcher made (BUNSAN_ERROR_DIR) and prints nothing; the launcher prints each distinct message once, with
the ranks that hit it. Launched otherwise (torchrun by hand, several nodes) each failing rank prints its own
one line (a rank's reason may be its own: a file missing on one node). BUNSAN_DEBUG=1 re-raises instead,
with the traceback (a ValueError or OSError can also be a bug).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bunsan.checkpoint.store import CheckpointError
from bunsan.comm.work import CommError
from bunsan.config.errors import ConfigError

__all__ = ["ERROR_DIR", "USER_ERRORS", "report", "print_collected"]

ERROR_DIR = "BUNSAN_ERROR_DIR"
# What bunsan raises for input it refuses (its messages name the value, the rule and the fix), and what
# the system says about files and disks. A bare RuntimeError or a TypeError is a bug: its traceback stays.
USER_ERRORS = (ConfigError, CheckpointError, CommError, ValueError, OSError)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report(cmd: str, e: BaseException) -> int:
    """Print (or hand to the launcher) one message for `e`; the exit code. BUNSAN_DEBUG=1: raise it."""
    if os.environ.get("BUNSAN_DEBUG") == "1":
        raise e
    message = f"{type(e).__name__}: {e}" if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) \
        else str(e)
    rank, folder = _rank(), os.environ.get(ERROR_DIR)
    if folder:
        (Path(folder) / f"rank{rank:05d}.json").write_text(json.dumps({"rank": rank, "message": message}))
    else:
        who = f" (rank {rank})" if rank else ""
        print(f"bunsan {cmd}{who}: {message}", file=sys.stderr)
    return 2


def print_collected(cmd: str, folder: Path) -> bool:
    """The launcher: each distinct message the ranks left, once, with their ranks. False if none left one."""
    by_message: dict[str, list[int]] = {}
    for f in sorted(folder.glob("rank*.json")):
        try:
            entry = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        by_message.setdefault(entry["message"], []).append(entry["rank"])
    for message, ranks in by_message.items():
        who = "every rank" if len(ranks) > 1 else f"rank {ranks[0]}"
        print(f"bunsan {cmd} ({who if len(ranks) == 1 else 'ranks ' + ', '.join(map(str, ranks))}): {message}",
              file=sys.stderr)
    return bool(by_message)
