"""Starting processes: torchrun (`torch.distributed.run`) does it all.

`bunsan run` hands torchrun the user's script (cli/run.py); `bunsan train --nproc N` (and
`generate` / `serve --tp N`) re-run the same command on N processes under torchrun,
the arguments travelling in the environment (torchrun's own parser would read
options such as --nproc that follow the module name).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from bunsan.cli.stopped_workers import StoppedWorkerWatch
from bunsan.comm.launched import AGENT_PID, agent_mark

WORKER_ARGV = "BUNSAN_WORKER_ARGV"


def worker_argv(argv: list[str]) -> list[str]:
    """A worker started by `relaunch` reads its real arguments from the environment."""
    return json.loads(os.environ[WORKER_ARGV]) if argv == [WORKER_ARGV] else argv


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


# torchrun's agents share their rendezvous TCPStore with the workers by default; after a restart the new
# workers find the dead ones' gloo addresses in it ("connectFullMesh failed ... Connection refused"). A
# store per round (this switch) makes restarts come up clean.
FRESH_STORE_PER_ROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _job_timeout(timeout_s: float | None) -> tuple[float, str]:
    """(seconds, what they are) a worker may stay stopped: the job's collective timeout."""
    import torch
    from bunsan.comm.process_group import collective_timeout
    if timeout_s is not None:
        return float(timeout_s), "train.timeout_s"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return collective_timeout(None, backend), f"the collective timeout on {backend}"


def relaunch(args, nproc: int, timeout_s: float | None = None) -> int:
    """Run this same command on `nproc` processes under torchrun; the exit code of the doctor's OOM advice
    survives when any process ran out of memory. `timeout_s`: the job's train.timeout_s, if it has one."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from bunsan.cli.errors import ERROR_DIR, print_collected
    os.environ[WORKER_ARGV] = json.dumps(args.argv)
    for k, v in FRESH_STORE_PER_ROUND.items():
        os.environ.setdefault(k, v)
    os.environ[AGENT_PID] = agent_mark()        # the workers end with this process (comm/launched.py)
    StoppedWorkerWatch(*_job_timeout(timeout_s)).start()   # and one stopped for good is killed (stopped_workers.py)
    with tempfile.TemporaryDirectory(prefix="bunsan-errors-") as folder:
        os.environ[ERROR_DIR] = folder      # each failing rank leaves its message here (cli/errors.py)
        try:
            torchrun(["--standalone", f"--nproc-per-node={nproc}", "--module", "bunsan.cli", WORKER_ARGV])
        except ChildFailedError as e:
            if not print_collected(args.cmd, Path(folder)):
                print(f"bunsan: {args.cmd} failed on {len(e.failures)} process(es); see their errors above",
                      file=sys.stderr)
            from bunsan.doctor.oom import EXIT_CODE
            return EXIT_CODE if any(f.exitcode == EXIT_CODE for f in e.failures.values()) else 2
        finally:
            os.environ.pop(ERROR_DIR, None)
        if print_collected(args.cmd, Path(folder)):    # (a rank that reported and still exited 0)
            return 2
    return 0
