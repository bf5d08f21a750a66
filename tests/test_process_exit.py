"""How ranks leave: one that finished waits for its peers (a gloo rank that leaves while a peer still holds its
connection can abort that peer's exit), one that is failing does not."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, time
    out, slow, failing = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    # registered before bunsan's exit handler, so it runs after it: when this rank is leaving
    atexit.register(lambda: open(f"{out}/left-{rank}", "w").write(repr(time.time())))
    from bunsan.comm.process_group import init_distributed
    init_distributed("gloo")
    if rank == failing:
        raise RuntimeError("this rank fails")
    if rank == slow:
        time.sleep(3)                       # still saving, say
    open(f"{out}/done-{rank}", "w").write(repr(time.time()))
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, slow: int, failing: int) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_port()), str(script), str(tmp_path), str(slow), str(failing)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    times = {f.name: float(f.read_text()) for f in tmp_path.iterdir() if f.name.startswith(("left", "done"))}
    return proc, times


def test_a_rank_that_finished_first_waits_for_its_peer_before_leaving(tmp_path):
    proc, t = _launch(tmp_path, slow=0, failing=-1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert t["left-1"] >= t["done-0"]           # rank 1 finished 3 s before rank 0 and left after it


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_rank_leaves_at_once_and_its_peer_soon_after(tmp_path, failing):
    other = 1 - failing
    proc, t = _launch(tmp_path, slow=other, failing=failing)
    assert proc.returncode != 0 and "this rank fails" in proc.stderr
    assert f"done-{failing}" not in t
    # the failing rank did not wait for its slow peer, whose exit then noticed it gone (no EXIT_WAIT_S wait)
    if f"left-{failing}" in t and f"done-{other}" in t:
        assert t[f"left-{failing}"] < t[f"done-{other}"]
    if f"left-{other}" in t:
        assert t[f"left-{other}"] - t[f"done-{other}"] < 30
