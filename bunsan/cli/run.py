"""`bunsan run ...`: torchrun with bunsan's bounds and messages.

Everything after `run` is torchrun's (a single node is --standalone). Added to it:
- set-up waits bounded by the job's timeout: for `-m bunsan.cli train ...` its train.timeout_s (read here
  from the same flags and config file the workers read), else what train.timeout_s unset means (120 s on
  gloo, 600 s on NCCL), the rendezvous' join, last-call and store-read timeouts (and a static rendezvous'
  `timeout`) unless --rdzv-conf names them. What torch keeps: its exit barrier (300 s, not settable from
  torchrun), entered only once this node's workers all succeeded.
- workers bound to this agent (BUNSAN_AGENT_PID: comm/launched.py), so a SIGKILLed agent leaves none behind;
- a worker stopped (SIGSTOP, a debugger) longer than the job's timeout killed (cli/stopped_workers.py), so
  that the job ends instead of waiting on it for ever;
- a fresh rendezvous store per round (launch.FRESH_STORE_PER_ROUND: restarts that work);
- a failed process, a node that never came, a lost store host: one bunsan line each, saying what to check.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys

from bunsan.cli.launch import FRESH_STORE_PER_ROUND
from bunsan.cli.stopped_workers import StoppedWorkerWatch
from bunsan.comm.launched import AGENT_PID, REACH, agent_mark
from bunsan.comm.work import first_line

CHECK = ("check that every node runs the same command with the same --nnodes and --rdzv-endpoint, and that the "
         f"endpoint's host {REACH}")


def setup_timeout(script: str, module: bool, script_args: list[str]) -> tuple[float, str]:
    """(seconds, where they come from) bounding this node's set-up waits."""
    import torch
    from bunsan.comm.process_group import collective_timeout
    if module and script == "bunsan.cli" and script_args[:1] == ["train"]:
        import argparse
        from bunsan.cli.train import add_parser, train_config
        parser = argparse.ArgumentParser(prog="bunsan")
        add_parser(parser.add_subparsers(dest="cmd"))
        cfg = train_config(parser.parse_args(script_args))
        backend = cfg.train.backend if cfg.train.backend not in (None, "auto") else \
            ("nccl" if torch.cuda.is_available() else "gloo")
        seconds = collective_timeout(cfg.train.timeout_s, backend)
        return seconds, "train.timeout_s" if cfg.train.timeout_s is not None else \
            f"train.timeout_s unset: {seconds:g} s on {backend}"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    seconds = collective_timeout(None, backend)
    return seconds, f"bunsan's default for a script whose train.timeout_s it cannot read: {seconds:g} s on {backend}"


def bounded_conf(conf: str, seconds: float) -> tuple[str, dict[str, str], set[str]]:
    """torchrun's --rdzv-conf with the set-up timeouts the user left out (theirs win): (the new string, all its
    settings, the keys bunsan added)."""
    settings = {k.strip(): v.strip() for k, v in (kv.split("=", 1) for kv in conf.split(",") if "=" in kv)}
    whole = max(1, math.ceil(seconds))
    ours = {k: str(v) for k, v in {"join_timeout": whole, "last_call_timeout": min(30, whole),
                                    "read_timeout": whole, "timeout": whole}.items() if k not in settings}
    return ",".join([c for c in [conf.strip()] if c] + [f"{k}={v}" for k, v in ours.items()]), \
        {**settings, **ours}, set(ours)


def run_script(rest: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                          RendezvousError, RendezvousTimeoutError)
    from torch.distributed import DistError
    from torch.distributed.run import parse_args, run
    from bunsan.cli.errors import USER_ERRORS, report
    if not rest:
        raise SystemExit("bunsan run: give the script to launch, e.g. bunsan run --nproc-per-node 2 train.py")
    multi_node = any(a.startswith(("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint")) for a in rest)
    args = parse_args((["--standalone"] if not multi_node else []) + rest)
    try:
        seconds, source = setup_timeout(args.training_script, args.module, args.training_script_args)
    except USER_ERRORS as e:          # a bad training config: said now, before any node waits for this one
        return report("train", e)
    args.rdzv_conf, conf, added = bounded_conf(args.rdzv_conf, seconds)

    def bound(key: str) -> str:
        return f"{conf[key]} s ({key}, {source if key in added else 'from --rdzv-conf'})"

    for k, v in FRESH_STORE_PER_ROUND.items():
        os.environ.setdefault(k, v)
    os.environ[AGENT_PID] = agent_mark()
    StoppedWorkerWatch(seconds, source).start()       # a stopped worker would hold every node for ever
    here = socket.gethostname()
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"
    try:
        record(run)(args)
    except ChildFailedError as e:
        failed = ", ".join(f"rank {r} ({_exit(f.exitcode)})" for r, f in sorted(e.failures.items())[:8])
        print(f"bunsan run: {len(e.failures)} process(es) on {here} failed: {failed}; their errors are above",
              file=sys.stderr)
        return 1
    except RendezvousTimeoutError:
        print(f"bunsan run: the {args.nnodes} node(s) of --nnodes did not all join the rendezvous at {endpoint} "
              f"within {bound('join_timeout')}; this node ({here}) "
              f"did, so the missing ones are those that print no such line: {CHECK}", file=sys.stderr)
        return 1
    except RendezvousConnectionError as e:   # the store's host (the endpoint's node) is gone or unreachable
        cause = first_line(e.__cause__) if e.__cause__ else str(e)
        print(f"bunsan run: {here} lost the rendezvous store at {endpoint}, or could not reach it within "
              f"{bound('read_timeout')} ({cause}); the agent on the endpoint's host holds it (the node of rank 0): "
              f"that node is down, was killed, or is not reachable from here. Check it and its log; {CHECK}",
              file=sys.stderr)
        return 1
    except RendezvousClosedError:
        print(f"bunsan run: the rendezvous at {endpoint} was closed: another node ended the job (its log says "
              "why); start every node again", file=sys.stderr)
        return 1
    except (RendezvousError, DistError) as e:   # (a static rendezvous: the agents' own store)
        print(f"bunsan run: the nodes did not come together at {endpoint} within {bound('timeout')} "
              f"({type(e).__name__}: {first_line(e)}); {CHECK}", file=sys.stderr)
        return 1
    return 0


def _exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"
