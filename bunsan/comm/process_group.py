"""Process start-up and device choice: the process group every other group is cut from.

`init_distributed` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); without it bunsan runs as a world of one, backed by an
in-memory store, so that the same code paths run everywhere. The device is chosen
once: CUDA + NCCL when a GPU is present, else CPU + gloo.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

from bunsan.comm.launched import REACH, die_with_agent, join_store
from bunsan.comm.work import CommError, first_line


DEFAULT_TIMEOUT_S = {"nccl": 600.0, "gloo": 120.0}   # train.timeout_s unset (see collective_timeout)
# The longest a rank that finished waits at exit for its peers to finish too (one still saving, say): past it,
# it exits alone (_destroy_at_exit).
EXIT_WAIT_S = 60.0
_FAILED: list = []     # this process is ending on a failure (note_failure, an uncaught exception, sys.exit(1))
_EXIT_HOOKED: list = []   # the failure hook and the exit teardown are installed (once per process)


def collective_timeout(timeout_s: float | None, backend: str) -> float:
    """The collective timeout: train.timeout_s, else 10 minutes on NCCL, where it is also the watchdog's and a
    first compiled step or a slow checkpoint barrier must not abort the job, and 2 minutes on gloo."""
    return float(timeout_s) if timeout_s is not None else DEFAULT_TIMEOUT_S.get(backend, 600.0)


def _visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")


def pick_device(backend: str | None = None) -> torch.device:
    """This process's GPU (cuda:LOCAL_RANK) when CUDA is present, else the CPU.

    Under NCCL every rank needs a GPU of its own: a rank without LOCAL_RANK, or with more ranks than visible
    GPUs, would put two ranks on one GPU and fail later with "Duplicate GPU detected", so it is refused here.
    gloo may share a GPU between ranks (backend "gloo": collectives through host memory)."""
    if not torch.cuda.is_available():
        if backend == "nccl":
            raise RuntimeError("backend 'nccl' needs CUDA GPUs, and none is visible (CUDA_VISIBLE_DEVICES="
                               f"{_visible()}); use train.backend 'gloo' (or 'auto') on CPU machines")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        if world > 1 and backend != "gloo":
            raise RuntimeError(f"WORLD_SIZE is {world} but LOCAL_RANK is not set, so this rank cannot tell which "
                               f"of the {count} visible GPUs (CUDA_VISIBLE_DEVICES={_visible()}) is its own; launch "
                               "with torchrun or `bunsan run` (they set LOCAL_RANK), or set LOCAL_RANK per process")
        local = "0"
    rank = int(local)
    if rank >= count:
        if backend == "gloo":
            return torch.device("cuda", rank % count)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if count == 1 and visible and "," not in visible:
            return torch.device("cuda", 0)    # the launcher gave each process its own one GPU (SLURM, k8s)
        raise RuntimeError(f"LOCAL_RANK {rank} has no GPU of its own: {count} visible (CUDA_VISIBLE_DEVICES="
                           f"{_visible()}), and NCCL cannot put two ranks on one GPU; launch at most {count} "
                           f"processes per node (--nproc-per-node {count}) or make more GPUs visible, or set "
                           "train.backend to 'gloo' to share GPUs (slow: collectives through host memory)")
    return torch.device("cuda", rank)


def backend_name() -> str:
    """The default process group's backend: 'nccl' or 'gloo'."""
    name = str(dist.get_backend())
    return "nccl" if "nccl" in name else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> torch.device:
    """Initialise torch.distributed once (reusing a group the user already made) and return the device.

    backend None or "auto": NCCL when a GPU is present, else gloo. timeout_s None: collective_timeout's default.
    """
    backend = None if backend in (None, "auto") else backend
    if dist.is_initialized():
        if not torch.cuda.is_available():
            return torch.device("cpu")
        bound = getattr(dist.group.WORLD, "bound_device_id", None)     # init_process_group(device_id=...)
        if bound is not None:
            device = bound
        elif "LOCAL_RANK" not in os.environ:
            device = torch.device("cuda", torch.cuda.current_device())   # the user chose it with set_device
        else:
            device = pick_device(backend_name())
        # events and streams (timings, offload copies) use the current device: make it this rank's
        torch.cuda.set_device(device)
        return device
    die_with_agent()       # (under torchrun: before any wait, so a killed agent leaves no orphan behind)
    device = pick_device(backend)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    seconds = collective_timeout(timeout_s, backend)
    timeout = datetime.timedelta(seconds=seconds)
    extra = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if backend == "nccl":
            extra["device_id"] = device   # communicators made at once, bound to this GPU
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = join_store(rank, world, seconds)       # every rank came, or the missing ones are named
        try:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                    **extra)
        except RuntimeError as e:      # every rank is in the store, but the transport cannot connect them
            if not any(w in str(e).lower() for w in ("connect", "timed out", "timeout", "refused", "reset",
                                                         "address", "closed", "unreachable")):
                raise
            detail = first_line(e)
            raise CommError(f"rank {rank} of {world}: every rank joined, but {backend} could not connect them "
                            f"within {seconds:g}s (train.timeout_s; {detail}): check that each host's name "
                            f"{REACH}") from None
    else:
        # A world of one: no launcher, no ports, same code paths.
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout, **extra)
    if not _EXIT_HOOKED:      # (once per process: one that makes its group again gets no second wrapper)
        sys.excepthook = _noting_failure(sys.excepthook)
        sys.exit = _noting_failed_exit(sys.exit)
        atexit.register(_destroy_at_exit)
        _EXIT_HOOKED.append(True)
    return device


def note_failure() -> None:
    """This process is ending on a failure it reported itself (an exit status, not an uncaught exception):
    it leaves without waiting for its peers at exit."""
    _FAILED.append(None)


def _noting_failure(hook):
    def excepthook(kind, value, traceback):
        _FAILED.append(value)
        hook(kind, value, traceback)
    return excepthook


def _noting_failed_exit(exit):
    """sys.exit, noting a failure status first (anything but None and 0, a message included, as Python exits
    with 1 for it): a script's `sys.exit(1)` and argparse's errors raise SystemExit, which never reaches the
    excepthook, and would otherwise leave the rank waiting out EXIT_WAIT_S for peers that may never come. Only
    on the main thread: elsewhere SystemExit ends that thread, not the process."""
    def noting_exit(status=None):
        if status is not None and status != 0 and threading.current_thread() is threading.main_thread():
            _FAILED.append(status)
        exit(status)
    return noting_exit


def _destroy_at_exit() -> None:
    """A process that exits with its process group alive can abort in the backend's teardown (torch 2.13 +
    gloo: "terminate called without an active exception", SIGABRT) after a run that finished: scripts rarely
    destroy the group themselves, so bunsan does, for the group it made. A gloo rank that leaves while a peer
    still holds a connection to it can abort that peer's exit the same way, so a rank that finished first
    (its peers still saving, say) waits for them at a barrier first, for at most EXIT_WAIT_S; one that is
    ending on a failure does not (its peers may never come)."""
    if not dist.is_initialized():
        return
    if not _FAILED and dist.get_world_size() > 1 and backend_name() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=EXIT_WAIT_S))
        except Exception:           # a peer failed, left, or is still busy past the wait: leave as it did
            pass
    dist.destroy_process_group()


def shutdown_distributed() -> None:
    """End a run in order: every rank reaches here before any closes its connections. A rank that exits while a
    peer still holds a gloo connection to it can abort that peer's own exit (std::terminate in gloo's
    teardown), failing a run that finished."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
