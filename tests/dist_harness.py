"""Spawned multi-process harness: gloo on CPU, world sizes 1/2/4, one pool per world size reused across tests.

A test sends a module-level function `fn(rank, *args)` to every worker of a pool
and gets back the list of per-rank results. A worker error or a timeout tears the
pool down (so no test waits on a broken group) and fails the test with the
worker's traceback; the next test gets a fresh pool. A job that leaves a shared-memory
ring (comm/shm.py) mapped once its objects are dropped fails too: bunsan keeps
something alive that a user's program, building engines repeatedly, would keep as well
(and the workers' memory would fill the machine).
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import queue
import traceback

from node_harness import free_port

TIMEOUT_S = 180  # a whole test function on every rank
COLLECTIVE_TIMEOUT_S = 60


def mapped_rings() -> int:
    """How many of bunsan's shared-memory files this process holds (a mapping keeps a descriptor)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += "bunsan-shm" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:             # the listing's own descriptor, closed by now
            pass
    return held


def _run_job(fn, args):
    result = fn(*args)
    if mapped_rings():
        gc.collect()                # cycles the job left are not leaks
        if mapped_rings():
            raise AssertionError(f"{fn.__name__} left {mapped_rings()} shared-memory ring(s) mapped after its "
                                 "objects were dropped: something it built is still referenced")
    return result


def _worker(rank: int, world: int, port: int, inbox, outbox, make_group: bool = True, threads: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    if make_group:   # (else the job makes it, e.g. bunsan.initialize from the environment)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, _run_job(fn, (rank, *args))))
        except BaseException:  # report everything, including assertion errors, to the parent
            outbox.put((rank, False, traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


class Pool:
    """`world` spawned ranks that run one job at a time; `make_group=False` leaves the process group to the
    job (the GPU self-check's ranks make theirs through bunsan.initialize)."""

    def __init__(self, world: int, make_group: bool = True, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.world = world
        port = free_port()
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.inboxes[r], self.outbox, make_group,
                                                        threads), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = TIMEOUT_S) -> list:
        for box in self.inboxes:
            box.put((fn, args))
        results: dict[int, object] = {}
        while len(results) < self.world:
            try:
                rank, ok, value = self.outbox.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"{fn.__name__} did not finish on ranks "
                                   f"{sorted(set(range(self.world)) - set(results))} within {timeout}s") from None
            if not ok:
                self.close(force=True)
                raise AssertionError(f"rank {rank} of {self.world} failed in {fn.__name__}:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for box in self.inboxes:
                box.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Pools:
    """One pool per world size, created on first use and recreated after a failure."""

    def __init__(self):
        self._pools: dict[int, Pool] = {}

    def run(self, world: int, fn, *args, timeout: float = TIMEOUT_S) -> list:
        pool = self._pools.get(world)
        if pool is None or not pool.alive():
            pool = self._pools[world] = Pool(world)
        try:
            return pool.run(fn, *args, timeout=timeout)
        except BaseException:
            self._pools.pop(world, None)
            raise

    def discard(self, world: int) -> None:
        pool = self._pools.pop(world, None)
        if pool is not None:
            pool.close(force=True)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
