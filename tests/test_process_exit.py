"""How ranks leave: one that finished waits for its peers (a gloo rank that leaves while a peer still holds its
connection can abort that peer's exit), one that is failing does not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from bunsan.comm.process_group import EXIT_WAIT_S
from node_harness import free_port

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, time
    out, slow, failing, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank = int(os.environ["RANK"])
    # registered before bunsan's exit handler, so it runs after it: when this rank is leaving
    atexit.register(lambda: open(f"{out}/left-{rank}", "w").write(repr(time.time())))
    from bunsan.comm.process_group import init_distributed
    init_distributed("gloo")
    if rank == failing and how == "thread":   # a worker thread's sys.exit ends that thread, not this rank
        import threading
        worker = threading.Thread(target=sys.exit, args=(3,))
        worker.start()
        worker.join()
    elif rank == failing and how == "raise":
        raise RuntimeError("this rank fails")
    elif rank == failing:                   # a script's own failure status: SystemExit, not an exception
        print("this rank fails", file=sys.stderr)
        sys.exit(3)
    if rank == slow:
        time.sleep(3)                       # still saving, say
    open(f"{out}/done-{rank}", "w").write(repr(time.time()))
""")


def _launch(tmp_path, slow: int, failing: int, how: str = "raise") -> tuple[subprocess.CompletedProcess, dict,
                                                                            float]:
    """The run, when each rank finished its work and left (where it got that far), and the run's seconds."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(tmp_path), str(slow), str(failing), how],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    times = {f.name: float(f.read_text()) for f in tmp_path.iterdir() if f.name.startswith(("left", "done"))}
    return proc, times, time.monotonic() - start


def test_a_rank_that_finished_first_waits_for_its_peer_before_leaving(tmp_path):
    proc, t, _ = _launch(tmp_path, slow=0, failing=-1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert t["left-1"] >= t["done-0"]           # rank 1 finished 3 s before rank 0 and left after it


def test_a_threads_sys_exit_is_no_failure_of_its_rank(tmp_path):
    """sys.exit(3) on a worker thread ends that thread only: the rank finishes and still waits for its peer."""
    proc, t, _ = _launch(tmp_path, slow=0, failing=1, how="thread")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert t["left-1"] >= t["done-0"]


@pytest.mark.parametrize("how", ["raise", "sys.exit(3)"])
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_rank_leaves_at_once_and_nobody_waits_out_the_barrier(tmp_path, failing, how):
    """A rank failing by an uncaught exception, or by its script's own sys.exit with a failure status."""
    other = 1 - failing
    proc, t, seconds = _launch(tmp_path, slow=other, failing=failing, how=how.split("(")[0])
    assert proc.returncode != 0 and "this rank fails" in proc.stderr
    assert f"done-{failing}" not in t and f"left-{failing}" in t
    # the failing rank left before its slow peer finished (torchrun may end the peer before it does)
    assert t[f"left-{failing}"] < t.get(f"done-{other}", float("inf"))
    assert seconds < EXIT_WAIT_S / 2                # nobody waited out the exit barrier


def test_a_process_that_makes_its_group_again_installs_the_exit_hooks_once():
    """init_distributed wraps sys.excepthook and sys.exit (to note a failure) and registers the exit teardown: once per
    process, not once per group made, so a process that makes and destroys groups repeatedly nests nothing."""
    script = textwrap.dedent("""
        import sys
        import torch.distributed as dist
        from bunsan.comm.process_group import init_distributed
        def ours(hook):          # bunsan's wrappers in the chain of hooks (torch adds its own per group)
            seen = 0
            while hook is not None:
                seen += hook.__qualname__.startswith(("_noting_failure", "_noting_failed_exit"))
                inner = [c.cell_contents for c in (getattr(hook, "__closure__", None) or ())
                         if callable(c.cell_contents)]
                hook = inner[0] if inner else None
            return seen
        for _ in range(3):
            init_distributed()
            dist.destroy_process_group()
        print(ours(sys.excepthook), ours(sys.exit))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1"], out.stdout
