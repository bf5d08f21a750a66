"""`bunsan doctor`: what to check before a long run, each check a line with ok / warn / fail and its reason.

    versions      python, torch, the backends (gloo, NCCL and CUDA when there is a GPU), optional packages
    devices       every GPU with its free memory, or the CPU with the host's available memory
    ranks         N local processes join a group and all-reduce (over gloo, and NCCL with GPUs) within a timeout;
                  under a launcher (one node or many), the ranks it started
    disk          free space where checkpoints go, against the size of one checkpoint of the model
    config        the config's peak per rank (bunsan estimate) against what each rank has
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass

import torch

from bunsan.memory.measure import host_available_bytes

GiB = 1024 ** 3
OPTIONAL = ("transformers", "tokenizers", "peft", "bitsandbytes", "starlette", "uvicorn", "deepspeed")


@dataclass
class Check:
    name: str
    status: str         # ok | warn | fail
    detail: str


def versions() -> list[Check]:
    out = [Check("python", "ok", platform.python_version()),
           Check("torch", "ok" if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
                 else "fail", f"{torch.__version__} (bunsan needs >= 2.6)")]
    backends = ["gloo" if torch.distributed.is_gloo_available() else None,
                "nccl" if torch.distributed.is_nccl_available() else None]
    out.append(Check("backends", "ok" if backends[0] else "fail",
                     ", ".join(b for b in backends if b) or "none: torch.distributed has no backend"))
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "-"
        out.append(Check("cuda", "ok", f"CUDA {torch.version.cuda}, NCCL {nccl}"))
    have = []
    for pkg in OPTIONAL:
        try:
            have.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            have.append(f"{pkg} -")
    out.append(Check("optional packages", "ok", ", ".join(have)))
    return out


def host_available() -> float:
    return float(host_available_bytes())


def devices() -> list[Check]:
    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            name = torch.cuda.get_device_name(i)
            out.append(Check(f"gpu {i}", "ok" if free > 0.5 * total else "warn",
                             f"{name}: {free / GiB:.1f} of {total / GiB:.1f} GiB free"
                             + ("" if free > 0.5 * total else " (another process holds the rest)")))
    try:
        avail = host_available()
        out.append(Check("host", "ok", f"{os.cpu_count()} CPUs, {avail / GiB:.1f} GiB available"))
    except (OSError, StopIteration):
        out.append(Check("host", "warn", f"{os.cpu_count()} CPUs, available memory unknown (no /proc/meminfo)"))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_all_reduce(comm, group, device: torch.device) -> tuple[bool, float]:
    """(the sum came out right, milliseconds) of a 4 MiB all-reduce (a bucket-sized message) through comm/collectives.py,
    after one to warm the connections up."""
    t = torch.ones(1 << 20, device=device)
    comm.all_reduce(t, group)
    start = time.perf_counter()
    comm.all_reduce(t, group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return float(t[0]) == group.size ** 2, (time.perf_counter() - start) * 1e3


def _world(timeout_s: float, device: torch.device):
    """(Comm on `device`, the world as a comm Group) of an initialised process group."""
    import torch.distributed as dist

    from bunsan.comm.collectives import Comm, Group
    rank, world = dist.get_rank(), dist.get_world_size()
    return Comm(timeout_s=timeout_s, device=device), Group("world", dist.group.WORLD, world, rank, tuple(range(world)))


def _rank_main(rank: int, world: int, port: int, backend: str, timeout_s: float, results) -> None:
    import torch.distributed as dist
    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
        ok, ms = _timed_all_reduce(*_world(timeout_s, device), device)
        dist.destroy_process_group()
        results.put((rank, ok, f"{ms:.1f} ms"))
    except Exception as e:
        results.put((rank, False, f"{type(e).__name__}: {e}"))


def ranks(nproc: int, timeout_s: float = 30.0) -> list[Check]:
    """Start `nproc` local processes per backend and all-reduce 4 MiB; name the ranks that fail or never answer."""
    import multiprocessing as mp
    out = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and torch.distributed.is_nccl_available() else 0
    backends = ["gloo"] + (["nccl"] if gpus >= 2 else [])      # NCCL needs a GPU per rank
    if gpus == 1:
        out.append(Check("ranks (nccl)", "ok", "one GPU: NCCL between ranks is not checked (one rank per GPU)"))
    for backend in backends:
        nproc = min(nproc, gpus) if backend == "nccl" else nproc
        ctx = mp.get_context("spawn")
        results, port = ctx.Queue(), _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, backend, timeout_s, results), daemon=True)
                 for r in range(nproc)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout_s + 30
        while len(got) < nproc and time.monotonic() < deadline:
            try:
                rank, ok, detail = results.get(timeout=1)
                got[rank] = (ok, detail)
            except Exception:
                if not any(p.is_alive() for p in procs):
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        silent = [r for r in range(nproc) if r not in got]
        bad = {r: d for r, (ok, d) in got.items() if not ok}
        if silent or bad:
            why = [f"rank {r}: {d}" for r, d in sorted(bad.items())] + [f"rank {r}: no answer (died)" for r in silent]
            out.append(Check(f"ranks ({backend})", "fail", f"{nproc} processes: " + "; ".join(why)))
        else:
            out.append(Check(f"ranks ({backend})", "ok", f"{nproc} processes joined; all-reduce of 4 MiB in "
                             + ", ".join(got[r][1] for r in range(nproc))))
    return out


def launched_world(timeout_s: float = 30.0) -> list[Check]:
    """Under a launcher (`bunsan run ... -m bunsan.cli doctor`, torchrun, one node or many): the ranks it
    started join one group; rank 0 hears every rank's host and the all-reduce's time."""
    import torch.distributed as dist
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else \
            torch.device("cpu")
        comm, group = _world(timeout_s, device)
        rank, world = group.rank, group.size
        _, ms = _timed_all_reduce(comm, group, device)
        # every rank's host name (64 bytes) and time, gathered as tensors
        name = torch.zeros(64, dtype=torch.uint8)
        raw = socket.gethostname().encode()[:64]
        name[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        names = torch.empty(64 * world, dtype=torch.uint8, device=device)
        times = torch.empty(world, dtype=torch.float64, device=device)
        comm.all_gather(names, name.to(device), group)
        comm.all_gather(times, torch.tensor([ms], dtype=torch.float64, device=device), group)
        hosts = [(bytes(n.tolist()).rstrip(b"\0").decode(errors="replace"), f"{t:.1f} ms")
                 for n, t in zip(names.cpu().view(world, 64), times.tolist())]
        dist.destroy_process_group()
    except Exception as e:
        return [Check(f"ranks ({backend})", "fail", f"the launched ranks did not all join or all-reduce within "
                      f"{timeout_s:g}s: {type(e).__name__}: {e}")]
    by_host: dict[str, int] = {}
    for h, _ in hosts:
        by_host[h] = by_host.get(h, 0) + 1
    return [Check(f"ranks ({backend})", "ok", f"{world} ranks on {len(by_host)} host(s) ("
                  + ", ".join(f"{h}: {n}" for h, n in by_host.items()) + "); all-reduce of 4 MiB in "
                  + ", ".join(ms for _, ms in hosts))] if rank == 0 else []


def disk(path: str, checkpoint_bytes: float | None) -> Check:
    target = os.path.abspath(path)
    probe = target
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    if checkpoint_bytes is None:
        return Check("disk", "ok", f"{free / GiB:.1f} GiB free at {target}")
    need = 2 * checkpoint_bytes        # the new checkpoint is written beside the previous one, then swapped
    status = "ok" if free >= need else "fail"
    return Check("disk", status, f"{free / GiB:.1f} GiB free at {target}; one checkpoint is "
                 f"{checkpoint_bytes / GiB:.2f} GiB (weights + optimizer states), a save needs room for two"
                 + ("" if status == "ok" else ": free space, or point checkpoint.dir elsewhere"))


def config(model, cfg, nproc: int, device_type: str) -> tuple[Check, float]:
    """(the estimate against each rank's memory, bytes of one checkpoint)."""
    from bunsan.estimator import estimate
    est = estimate(model, cfg, gpus=nproc, device_type=device_type)
    if device_type == "cuda":
        have = min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        where = "the smallest GPU's free memory"
    else:
        have, where = host_available() / nproc, f"available host memory / {nproc} ranks"
    from bunsan.memory.theory import optimizer_state_bytes_per_param
    opt = cfg.optimizer
    ckpt = est.n_params * (4 + optimizer_state_bytes_per_param(opt.type, opt.params))   # fp32 master + states
    status = "ok" if est.peak <= 0.9 * have else "fail"
    detail = (f"{est.model} on {nproc} ranks ({est.layout.describe()}): peak {est.peak / GiB:.2f} GiB per rank "
              f"predicted, {have / GiB:.2f} GiB available ({where})")
    if status == "fail":
        detail += f"; it does not fit: bunsan plan --model {est.model} --gpus {nproc} lists layouts that do"
    return Check("config", status, detail), ckpt
