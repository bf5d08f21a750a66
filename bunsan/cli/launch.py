"""Starting processes: torchrun (`torch.distributed.run`) does it all.

`bunsan run` hands torchrun the user's script; `bunsan train --nproc N` (and
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
CHECK = ("check that every node runs the same command with the same --nnodes and --rdzv-endpoint, that the "
         "endpoint's host resolves to an address every node can reach (a hostname resolving to 127.0.1.1 "
         "breaks gloo), and that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name the interface between the nodes")


def run_script(rest: list[str]) -> int:
    """`bunsan run ...`: everything after `run` is torchrun's (a single node is --standalone)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun
    if not rest:
        raise SystemExit("bunsan run: give the script to launch, e.g. bunsan run --nproc-per-node 2 train.py")
    multi_node = any(a.startswith(("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint")) for a in rest)
    for k, v in FRESH_STORE_PER_ROUND.items():
        os.environ.setdefault(k, v)
    try:
        torchrun((["--standalone"] if not multi_node else []) + rest)
    except ChildFailedError as e:
        failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(e.failures.items())[:8])
        print(f"bunsan run: {len(e.failures)} process(es) failed: {failed}; their errors are above", file=sys.stderr)
        return 1
    except RendezvousError as e:     # (timeouts included: a node missing or late, a lost store host)
        detail = f": {str(e)[:200]}" if str(e) else ""
        print(f"bunsan run: not every node joined within the rendezvous timeout (--rdzv-conf join_timeout=S, "
              f"torch's default 600 s; {type(e).__name__}{detail}); {CHECK}", file=sys.stderr)
        return 1
    return 0


def relaunch(args, nproc: int) -> int:
    """Run this same command on `nproc` processes under torchrun; the exit code of the doctor's OOM advice
    survives when any process ran out of memory."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun
    from bunsan.cli.errors import ERROR_DIR, print_collected
    os.environ[WORKER_ARGV] = json.dumps(args.argv)
    for k, v in FRESH_STORE_PER_ROUND.items():
        os.environ.setdefault(k, v)
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


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
