"""Multi-process harness: gloo on CPU, world sizes 1/2/4, one pool per world size reused across tests.

A test sends a module-level function `fn(rank, *args)` to every worker of a pool and gets back the list of
per-rank results; `Pools.cli` runs a `bunsan` command line on every rank, as torchrun's workers would, and
returns each rank's exit code and output (docs/testing.md says when a test should).

Workers are forked from a forkserver that has imported torch, bunsan and transformers once, so a new pool
costs a fork, not a Python start-up. Their process group is cut from a store the harness keeps, so a job that
destroys the group (a command's clean shutdown) or fails on every rank leaves a pool that makes a fresh group
and goes on. A rank that does not answer tears the pool down (no test waits on a broken group) and fails the
test with what the ranks said; the next test gets a fresh pool. A job that leaves a shared-memory ring
(comm/shm.py) mapped once its objects are dropped fails too: bunsan keeps something alive that a user's
program, building engines repeatedly, would keep as well (and the workers' memory would fill the machine).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback

from node_harness import free_port

TIMEOUT_S = 180  # a ceiling on a whole test function on every rank: it only catches hangs
COLLECTIVE_TIMEOUT_S = 60
# After one rank fails, how long its peers may take to report too (each then makes a fresh group and the pool
# lives on); past it the pool is replaced. Either way the test gets the same failure.
PEERS_REPORT_S = 10
START_OVER = "start over"
TERM_GRACE_S = 3     # a torn-down worker's time to leave on SIGTERM before it is killed

# Imported once, in the forkserver every worker is forked from (a module missing here is skipped).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "bunsan", "bunsan.engine.engine", "bunsan.cli.main",
           "transformers", "parity"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


CONTEXT = _context()


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


class _Group:
    """This worker's default process group, cut from the harness's store under a new prefix each time it is
    made again (a job destroyed it, or a failed job left it in an unknown state)."""

    def __init__(self, rank: int, world: int, store_port: int):
        import torch.distributed as dist
        self.dist, self.rank, self.world, self.made = dist, rank, world, 0
        self.store = dist.TCPStore("127.0.0.1", store_port, world, is_master=rank == 0,
                                   timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def make(self) -> None:
        dist = self.dist
        if dist.is_initialized():
            dist.destroy_process_group()
        self.made += 1
        dist.init_process_group("gloo", store=dist.PrefixStore(f"group{self.made}", self.store), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _worker(rank: int, world: int, port: int, store_port: int, inbox, outbox, make_group: bool = True,
            threads: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(threads)
    group = None
    if make_group:   # (else the job makes it, e.g. bunsan.initialize from the environment)
        group = _Group(rank, world, store_port)
        group.make()
    while True:
        job = inbox.get()
        if job is None:
            break
        if job == START_OVER:       # a job failed, every rank reported: every rank makes a fresh group
            group.make()
            outbox.put((rank, True, "fresh group"))
            continue
        fn, args = job
        try:
            reply = (rank, True, _run_job(fn, (rank, *args)))
        except BaseException:  # report everything, including assertion errors, to the parent
            reply = (rank, False, traceback.format_exc())
        if group is not None and not group.dist.is_initialized():
            try:        # the job ended the group (a command's clean shutdown): every rank makes the next one
                group.make()
            except BaseException:
                reply = (rank, False, f"{reply[2]}\n(the harness could not make the group again:\n"
                                      f"{traceback.format_exc()})")
        outbox.put(reply)
    if group is not None and group.dist.is_initialized():
        group.dist.destroy_process_group()


class Pool:
    """`world` forked ranks that run one job at a time; `make_group=False` leaves the process group to the
    job (the GPU self-check's ranks make theirs through bunsan.initialize)."""

    def __init__(self, world: int, make_group: bool = True, threads: int = 1):
        self.world, self.make_group = world, make_group
        port, store_port = free_port(), free_port()
        self.outbox = CONTEXT.Queue()
        self.inboxes = [CONTEXT.Queue() for _ in range(world)]
        self.procs = [CONTEXT.Process(target=_worker, args=(r, world, port, store_port, self.inboxes[r],
                                                            self.outbox, make_group, threads), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def _collect(self, name: str, timeout: float) -> dict[int, tuple[bool, object]]:
        """Every rank's (ok, value); after the first failure the others get PEERS_REPORT_S to report."""
        replies: dict[int, tuple[bool, object]] = {}
        while len(replies) < self.world:
            failed = any(not ok for ok, _ in replies.values())
            try:
                rank, ok, value = self.outbox.get(timeout=PEERS_REPORT_S if failed else timeout)
            except queue.Empty:
                self.close(force=True)
                missing = sorted(set(range(self.world)) - set(replies))
                said = "".join(f"\nrank {r} of {self.world} failed in {name}:\n{v}"
                               for r, (ok, v) in sorted(replies.items()) if not ok)
                raise (AssertionError if failed else TimeoutError)(
                    f"{name} did not finish on ranks {missing} within {timeout}s{said}") from None
            replies[rank] = (ok, value)
        return replies

    def run(self, fn, *args, timeout: float = TIMEOUT_S) -> list:
        for box in self.inboxes:
            box.put((fn, args))
        replies = self._collect(fn.__name__, timeout)
        failed = {r: v for r, (ok, v) in replies.items() if not ok}
        if failed:
            if self.make_group:     # every rank reported: a fresh group, and the pool goes on
                for box in self.inboxes:
                    box.put(START_OVER)
                self._collect("making a fresh group", COLLECTIVE_TIMEOUT_S)
            else:
                self.close(force=True)
            raise AssertionError("".join(f"rank {r} of {self.world} failed in {fn.__name__}:\n{v}"
                                         for r, v in sorted(failed.items())))
        return [replies[r][1] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for box in self.inboxes:
                box.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:    # SIGTERM first: a worker's atexit work (scripts/coverage's data) is not lost
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=TERM_GRACE_S)
            if p.is_alive():        # stuck where no signal handler runs (a collective in C): killed
                p.kill()
                p.join(timeout=5)


class Result:
    """A command's exit code and output, as subprocess.run's CompletedProcess names them."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

    def __repr__(self) -> str:
        return f"Result(returncode={self.returncode}, stdout={self.stdout[-2000:]!r}, stderr={self.stderr[-2000:]!r})"


@contextlib.contextmanager
def _captured(fd: int):
    """What this process writes to `fd` (Python's and C's writes alike), read back as text on exit."""
    text: list[str] = []
    stream = sys.stdout if fd == 1 else sys.stderr
    with tempfile.TemporaryFile("w+b") as file:
        stream.flush()
        saved = os.dup(fd)
        os.dup2(file.fileno(), fd)
        try:
            yield text
        finally:
            with contextlib.suppress(Exception):
                stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            file.seek(0)
            text.append(file.read().decode(errors="replace"))


def cli_job(rank: int, argv: list[str], env: dict | None = None, cwd: str | None = None) -> Result:
    """A pool job: `bunsan ARGV` on this rank as torchrun's worker would run it (its environment names the
    rank; the command reuses the pool's process group)."""
    from bunsan.cli.main import main
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env or {})
    try:
        with _captured(1) as out, _captured(2) as err:
            if cwd:
                os.chdir(cwd)
            try:
                code = main(list(argv))
            except SystemExit as e:         # argparse, or a command's own sys.exit
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return Result(int(code or 0), out[0], err[0])


class Pools:
    """One pool per world size, created on first use and recreated after it was torn down."""

    def __init__(self):
        self._pools: dict[int, Pool] = {}

    def run(self, world: int, fn, *args, timeout: float = TIMEOUT_S) -> list:
        pool = self._pools.get(world)
        if pool is None or not pool.alive():
            pool = self._pools[world] = Pool(world)
        try:
            return pool.run(fn, *args, timeout=timeout)
        except BaseException:
            if not pool.alive():
                self._pools.pop(world, None)
            raise

    def cli(self, world: int, argv: list[str], *, env: dict | None = None, cwd=None,
            timeout: float = TIMEOUT_S) -> list[Result]:
        """`bunsan ARGV` on `world` ranks of a pool (`train --nproc N` runs its workers' part here, as torchrun
        would start it): each rank's exit code, stdout and stderr."""
        return self.run(world, cli_job, [str(a) for a in argv], env, str(cwd) if cwd else None, timeout=timeout)

    def discard(self, world: int) -> None:
        pool = self._pools.pop(world, None)
        if pool is not None:
            pool.close(force=True)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
