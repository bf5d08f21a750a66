"""Two machines simulated on one: each "node" is a `bunsan run` agent in its own PID, mount and UTS
namespaces (its own hostname, resolving to loopback through its own /etc/hosts, and a private tmpfs where
its caches live), meeting over loopback through c10d. Skipped where the machine does not allow namespaces
(they need root)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

BUNSAN = [sys.executable, "-m", "bunsan.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GLOO_SOCKET_IFNAME": "lo"}


def _namespaces_work() -> str | None:
    probe = subprocess.run(["unshare", "--pid", "--mount", "--uts", "--fork", "true"], capture_output=True)
    return None if probe.returncode == 0 else (probe.stderr.decode()[:200] or "unshare failed")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import argparse
    import inspect
    import json
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.py").write_text("\n".join(inspect.getsource(m) for m in (json, argparse)))
    return d


def _train_args(corpus, out, local, extra=()):
    return ["train", "--preset", "tiny", "--steps", "3", "--micro-batch", "2", "--seq-len", "64",
            "--data", str(corpus / "*.py"), "--output", str(out), "--set", f"data.cache_dir={local}/cache",
            "--set", "data.val_fraction=0", "--timeout", "60", *extra]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, corpus, extra=()):
    why = _namespaces_work()
    if why:
        pytest.skip(f"no PID/mount/UTS namespaces here: {why}")
    local = tmp_path / "node-local"        # each node mounts its own tmpfs here
    local.mkdir()
    # each node's name resolves to its own loopback address (mounted over /etc/hosts): one address for both
    # would make them one node to the rendezvous (same name, and the same pid in their namespaces)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.2 node0\n127.0.0.3 node1\n")
    port, out = _free_port(), tmp_path / "out"
    train = " ".join(_train_args(corpus, out, local, extra))
    procs = []
    for node in range(2):
        script = (f"hostname node{node} && mount --bind {hosts} /etc/hosts && mount -t tmpfs tmpfs {local} && "
                  f"exec {' '.join(BUNSAN)} run "
                  f"--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} "
                  f"--rdzv-conf join_timeout=60 -m bunsan.cli {train}")
        procs.append(subprocess.Popen(["unshare", "--pid", "--mount", "--uts", "--fork", "--mount-proc", "sh",
                                       "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=ENV, cwd=tmp_path))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    return [p.returncode for p in procs], logs, out


def test_two_nodes_with_node_local_caches_match_one_node(tmp_path, corpus):
    codes, logs, out = _two_nodes(tmp_path, corpus)
    assert codes == [0, 0], "\n".join(logs)
    one = subprocess.run(BUNSAN + _train_args(corpus, tmp_path / "one", tmp_path / "one-cache") + ["--nproc", "2"],
                         capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    a = load_file(str(out / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_node_local_checkpoint_directory_is_named_at_start_up(tmp_path, corpus):
    codes, logs, _ = _two_nodes(tmp_path, corpus, ("--checkpoint-dir", str(tmp_path / "node-local" / "ckpt")))
    assert codes != [0, 0]
    assert any("is not shared" in log for log in logs), "\n".join(logs)
