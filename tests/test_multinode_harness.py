"""Two machines simulated on one (tests/node_harness.py: PID, mount and UTS namespaces, node-local tmpfs caches,
c10d over loopback): each layout across two nodes ends bit-equal to the same run on one node, a worker killed on
one node is restarted on both and the run still ends bit-equal, and a node-local checkpoint directory is named
at start-up. Skipped where the machine does not allow namespaces (they need root).

Bit-equal across placements: every reduction of these layouts runs over a group of two ranks (data-parallel
gradients and token counts, tensor-parallel partial sums, the norm's pieces), and a sum of two numbers is the
same bits whichever transport adds them (shared memory inside a node, gloo's TCP between nodes) in whichever
order. The one-node reference runs on a pool's ranks (`pools.cli`: the workers' part of `train --nproc N`, the
same code and transports as a launch, without one).

Each two-node run costs a launch of every process, so each case below covers what no other does:

    case                           per node  crosses the nodes              also covers (merged here)
    tp-across                      1         tensor-parallel partial sums   -
    pp                             1         pipeline sends and receives    gradient accumulation over micro-batches
    zero3-across-tp-inside         2         ZeRO-3 gathers and scatters    TP 2 inside each node (shared memory
                                                                            and TCP in one step: the former
                                                                            tp-inside-dp-across), ZeRO-3 (former
                                                                            zero3 at 1 per node)
    killed and restarted (below)   1         plain data-parallel gradients  the former dp layout; a kill on each
                                                                            node (node0's agent hosts the store),
                                                                            the second a second restart round
    node-local checkpoint dir      1         -                              -
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from node_harness import BUNSAN, Cluster

pytestmark = pytest.mark.e2e        # every case starts simulated machines, their agents and their workers

CEILING_S = 300     # a whole two-node run: only a hang reaches it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import argparse
    import inspect
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (json, argparse)))
    return d


def _train_args(corpus, out, cache, extra=(), steps=3):
    # (--timeout bounds set-up and every collective: large, so that a loaded machine never reaches it)
    return ["train", "--preset", "tiny", "--steps", str(steps), "--micro-batch", "2", "--seq-len", "64",
            "--data", str(corpus / "*.py"), "--output", str(out), "--set", f"data.cache_dir={cache}",
            "--set", "data.val_fraction=0", "--timeout", "120", *extra]


def _on_two_nodes(tmp_path, corpus, extra=(), nproc=1, restarts=0, script=("-m", "bunsan.cli"), steps=3):
    """Run `bunsan train` on two simulated nodes: (exit codes, logs, output directory)."""
    out = tmp_path / "out"
    with Cluster(tmp_path) as cluster:
        argv = BUNSAN + cluster.run_args(nproc, restarts) + list(script) + \
            _train_args(corpus, out, cluster.local / "cache", extra, steps)
        for node in range(2):
            cluster.start(node, argv)
        codes = cluster.wait_all(CEILING_S)
        return codes, cluster.logs(), out


def _on_one_node(pools, tmp_path, corpus, nproc, extra=(), steps=3):
    one = tmp_path / "one"
    ranks = pools.cli(nproc, _train_args(corpus, one, tmp_path / "one-cache", extra, steps) + ["--nproc", str(nproc)],
                      cwd=tmp_path)
    assert [r.returncode for r in ranks] == [0] * nproc, ranks
    return load_file(str(one / "final" / "model.safetensors"))


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# name: (processes per node, flags): with 2 per node, TP 2 inside each node and DP 2 across the two
LAYOUTS = {"tp-across": (1, ("--tp", "2")), "pp": (1, ("--pp", "2", "--grad-accum", "2")),
           "zero3-across-tp-inside": (2, ("--tp", "2", "--zero", "3"))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_nodes_with_node_local_caches_match_one_node(pools, tmp_path, corpus, layout):
    nproc, extra = LAYOUTS[layout]
    codes, logs, out = _on_two_nodes(tmp_path, corpus, extra, nproc)
    assert codes == [0, 0], logs
    _assert_equal(load_file(str(out / "final" / "model.safetensors")),
                  _on_one_node(pools, tmp_path, corpus, 2 * nproc, extra))


def test_a_node_local_checkpoint_directory_is_named_at_start_up(tmp_path, corpus):
    codes, logs, _ = _on_two_nodes(tmp_path, corpus, ("--checkpoint-dir", str(tmp_path / "node-local" / "ckpt")))
    assert codes != [0, 0]
    assert "is not shared" in logs, logs


# A worker SIGKILLs itself after the steps below, before that step's checkpoint, once each (a marker file per
# kill on the shared filesystem): what an OOM kill or a crash looks like to the agents, at steps known in
# advance. One kill on each node: node0's agent hosts the rendezvous store, and its worker is as mortal as
# node1's; the second kill is a second restart round (the fresh store per round: cli/launch.py). More kills
# would repeat these.
KILLS = {2: "node1", 4: "node0"}
FAULTY = textwrap.dedent("""
    import os, signal, socket, sys
    from pathlib import Path
    import bunsan.engine.engine as engine
    train_batch = engine.Engine.train_batch
    KILLS = %r
    def dying(self, batch):
        out = train_batch(self, batch)
        marker = Path(__file__).with_name(f"killed-{self.global_step}")
        if KILLS.get(self.global_step) == socket.gethostname() and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    engine.Engine.train_batch = dying
    from bunsan.cli.main import main
    sys.exit(main(sys.argv[1:]))
""") % (KILLS,)


def test_a_worker_killed_on_each_node_restarts_on_both_and_ends_bit_equal(pools, tmp_path, corpus):
    """--max-restarts 2: a kill on node1, then one on node0; each time the node's agent restarts its worker and
    the other agent its own (the rendezvous' new round), both resume from the newest whole checkpoint (the step
    before the kill), and the run ends bit-equal to an uninterrupted one."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    steps = max(KILLS) + 1
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-interval", "1", "--set", "steps_per_print=1")
    codes, logs, out = _on_two_nodes(tmp_path, corpus, ckpt, restarts=len(KILLS), script=(str(script),),
                                     steps=steps)
    assert codes == [0, 0], logs
    assert all((tmp_path / f"killed-{k}").exists() for k in KILLS), logs
    for k in KILLS:
        assert re.search(rf"global_step{k - 1}\b", logs), (k, logs)
    assert logs.count("resumed from") >= len(KILLS), logs
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seen = [r["step"] for r in records if "loss" in r]
    assert seen == sorted(set(seen)) and seen[0] == 1 and seen[-1] == steps, seen   # one history, nothing twice
    one_ckpt = ("--checkpoint-dir", str(tmp_path / "one-ckpt"), "--save-interval", "1", "--set", "steps_per_print=1")
    _assert_equal(load_file(str(out / "final" / "model.safetensors")),
                  _on_one_node(pools, tmp_path, corpus, 2, one_ckpt, steps))
