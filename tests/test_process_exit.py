"""How ranks leave: one that finished waits for its peers (a gloo rank that leaves while a peer still holds its
connection can abort that peer's exit), one that is failing does not.

No clock in an assertion: each rank notes, as it leaves, which ranks had finished their work by then, and the
exit barrier's bound (EXIT_WAIT_S) is raised past the ceiling of the run, so a failing rank that waited there
would hang the run instead of leaving late, and the ceiling fails the test.

    case                                  what it adds
    a thread's sys.exit, rank 1 first     the finished rank waits for its peer (the former plain case: the
                                          thread's exit changes nothing else); a thread's exit is no failure
    rank 0 raises                         an uncaught exception (the excepthook) ends the rank at once
    rank 1 calls sys.exit(3)              a script's failure status (SystemExit, no exception) likewise
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from node_harness import free_port

pytestmark = pytest.mark.e2e        # torchrun launches, or a process of its own whose exit hooks are counted

CEILING_S = 240     # a launch of two ranks: only a hang reaches it

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, time
    from pathlib import Path
    out, slow, failing, how = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    rank = int(os.environ["RANK"])
    # registered before bunsan's exit handler, so it runs after it: as this rank leaves, which ranks had finished
    atexit.register(lambda: (out / f"left-{rank}").write_text(" ".join(sorted(p.name for p in out.glob("done-*")))))
    import bunsan.comm.process_group as process_group
    process_group.EXIT_WAIT_S = 3600        # waited out, it would be a hang: the test's ceiling catches it
    process_group.init_distributed("gloo")
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
        if failing >= 0 and how != "thread":  # its work never ends: the failing peer must leave without it
            time.sleep(3600)                # (until torchrun ends it, once the failing rank has left)
        while not (out / f"done-{1 - rank}").exists():      # the peer finished first, for certain
            time.sleep(0.05)
        time.sleep(1)                       # still saving, say: a peer that did not wait would be gone by now
    (out / f"done-{rank}").write_text("")
""")


def _launch(tmp_path, slow: int, failing: int, how: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The run, and for each rank that left by its own exit path, the ranks that had finished by then."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(script), str(out), str(slow), str(failing), how],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=CEILING_S)
    except subprocess.TimeoutExpired as e:      # (the ranks end with torchrun: comm/launched.py)
        pytest.fail(f"the run hung (a rank waiting at the exit barrier?):\n{(e.stderr or b'')[-3000:]!r}")
    left = {int(f.name.split("-")[1]): set(f.read_text().split()) for f in out.glob("left-*")}
    return proc, left


def test_a_rank_that_finished_first_waits_for_its_peer_and_a_threads_sys_exit_is_no_failure(tmp_path):
    """sys.exit(3) on rank 1's worker thread ends that thread only: the rank finishes, first, and leaves only
    once rank 0 has finished too."""
    proc, left = _launch(tmp_path, slow=0, failing=1, how="thread")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert left[1] == {"done-0", "done-1"}, left


@pytest.mark.parametrize("failing,how", [(0, "raise"), (1, "sys.exit(3)")])
def test_a_failing_rank_leaves_at_once_and_nobody_waits_out_the_barrier(tmp_path, failing, how):
    """A rank failing by an uncaught exception, or by its script's own sys.exit with a failure status, while its
    peer's work never ends: it leaves without waiting for it, and torchrun ends the peer."""
    other = 1 - failing
    proc, left = _launch(tmp_path, slow=other, failing=failing, how=how.split("(")[0])
    assert proc.returncode != 0 and "this rank fails" in proc.stderr, proc.stderr[-3000:]
    assert left.get(failing) == set(), left         # it left, having done nothing, its peer not done either
    assert other not in left                        # the peer never finished: torchrun ended it


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
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CEILING_S, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "1"], out.stdout
