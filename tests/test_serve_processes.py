"""`bunsan serve` in its two processes (serve/engine.py, engine_client.py), started as a user starts it: what
crosses between them arrives whole (a cancelled stream frees its blocks in the model's process, images reach
it once per prompt, a grammar is rebuilt there, adapters load there), and when either process goes, the
other does too instead of hanging; SIGTERM drains as in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from parity import tiny_model  # noqa: E402
from serve_harness import free_port, offline, wait_until_healthy  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from bunsan.models.hf import save_llama
    folder = tmp_path_factory.mktemp("llama")
    model = tiny_model(0).eval()
    save_llama(model.state_dict(), model.config, folder)
    return folder, model


class Served:
    def __init__(self, folder, *flags):
        self.port = free_port()
        # a session of its own, as a terminal's: Ctrl-C is its whole process group's SIGINT
        self.proc = subprocess.Popen([sys.executable, "-m", "bunsan.cli", "serve", "--checkpoint", str(folder),
                                      "--port", str(self.port), "--context", "96", *flags], env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until_healthy(self.proc, self.url)

    def http_pid(self) -> int:
        """The HTTP process: the model's process's child that multiprocessing spawned."""
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        spawned = [int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(spawned) == 1, children
        return spawned[0]

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        if self.proc.stdout.closed:
            self.proc.wait(60)
            return ""
        out, _ = self.proc.communicate(timeout=60)
        return out


@pytest.fixture(scope="module")
def served(llama_dir):
    s = Served(llama_dir[0], "--slots", "4")
    yield s
    s.close()


def test_answers_cross_the_processes_as_generate_gives_them(served, llama_dir):
    from bunsan.training.data import load_tokenizer
    model, tokenizer = llama_dir[1], load_tokenizer(None)
    prompts = ["def f(x):", "import os", "class A:"]
    for prompt in prompts:
        r = httpx.post(served.url + "/v1/completions", timeout=60,
                       json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline(model, tokenizer, prompt, 10)
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 10
    embedded = httpx.post(served.url + "/v1/embeddings", json={"input": ["hello", "world"]}, timeout=60).json()
    assert [len(d["embedding"]) for d in embedded["data"]] == [model.config.hidden_size] * 2
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "n"}], "max_tokens": 30, "temperature": 1, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).json()
    assert "choices" in shaped, shaped
    assert isinstance(json.loads(shaped["choices"][0]["message"]["content"])["n"], int)
    name = httpx.get(served.url + "/v1/models").json()["data"][0]["id"]
    show = httpx.post(served.url + "/api/show", json={"model": name}).json()
    assert show["model_info"]["general.parameter_count"] == sum(p.numel() for p in model.parameters())


def _cores(pid: int) -> set[str]:
    """Every thread's allowed CPUs (Cpus_allowed_list) of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = open(f"/proc/{pid}/task/{tid}/status").read()
        out.add(next(line.split(":")[1].strip() for line in status.splitlines()
                     if line.startswith("Cpus_allowed_list")))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding leaves the HTTP process a core: needs two")
def test_the_models_threads_are_bound_to_their_cores_and_the_http_process_is_not(served, llama_dir):
    """--cpu-bind auto (the default): every thread of the model's process on the last cores this process may
    use, as many as its torch threads (--threads' default: all but one), the HTTP process on all of them;
    --cpu-bind none leaves both to the scheduler."""
    allowed = sorted(os.sched_getaffinity(0))
    model_cores = allowed[1:]
    want = f"{model_cores[0]}-{model_cores[-1]}" if len(model_cores) > 1 else str(model_cores[0])
    assert _cores(served.proc.pid) == {want}
    everything = _cores(served.http_pid())
    assert len(everything) == 1 and everything != {want}
    free = Served(llama_dir[0], "--slots", "2", "--cpu-bind", "none")
    try:
        assert _cores(free.proc.pid) == _cores(free.http_pid()) == everything
    finally:
        free.close()


def test_a_cancelled_sequence_stops_in_the_models_process(llama_dir):
    """The two sides over a pipe in this process, each forward slowed to 50 ms: a sequence cancelled on the
    HTTP side (a stop string, a client gone) ends in the model's process within a few steps, its blocks back."""
    import multiprocessing
    import threading

    from bunsan.serve.batcher import Batcher, Request
    from bunsan.serve.engine import Engine, model_facts
    from bunsan.serve.engine_client import EngineClient
    from bunsan.training.data import load_tokenizer
    batcher = Batcher(llama_dir[1], 2, 96)
    forward = batcher._forward
    batcher._forward = lambda *a: (time.sleep(0.05), forward(*a))[1]
    here, there = multiprocessing.Pipe()
    engine = Engine(batcher, load_tokenizer(None), here)
    client = EngineClient(there, model_facts(batcher))
    threads = [threading.Thread(target=t, daemon=True) for t in (engine.listen, engine.run, client.run)]
    for t in threads:
        t.start()
    tokens, ended = [], []
    r = Request([5, 6, 7], 60, emit=tokens.append, finish=ended.append)
    client.submit(r)
    deadline = time.monotonic() + 30
    while len(tokens) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    r.cancelled = True
    while not ended and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert ended == ["cancelled"] and len(tokens) < 20, (ended, len(tokens))
        assert batcher.pool.available() == batcher.pool.usable and client.pool.available() == batcher.pool.usable
    finally:
        client.stop()
        for t in threads:
            t.join(10)
    assert client.stopped and not batcher.running


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_signal_drains_then_both_processes_end(llama_dir, how):
    """SIGTERM to the model's process, or Ctrl-C (SIGINT to both): one graceful drain (a second signal would
    be uvicorn's forced exit), the running stream ends with its [DONE], both processes leave, status 0."""
    s = Served(llama_dir[0], "--shutdown-grace", "0.5")
    http = s.http_pid()
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"prompt": "a", "max_tokens": 90, "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        if how == "sigterm":
            s.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(s.proc.pid, signal.SIGINT)
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    out = s.close()
    assert s.proc.returncode == 0, out
    assert not os.path.exists(f"/proc/{http}") or "zombie" in open(f"/proc/{http}/status").read().lower()


@pytest.mark.parametrize("killed", ["model", "http"])
def test_when_one_process_dies_the_other_ends(llama_dir, killed):
    """Killed as a test harness or a supervisor kills it: its output's reader gone too (the HTTP process
    then cannot print why it stops, and stops all the same)."""
    s = Served(llama_dir[0])
    http = s.http_pid()
    if killed == "model":
        s.proc.stdout.close()
    os.kill(s.proc.pid if killed == "model" else http, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (os.path.exists(f"/proc/{http}") or s.proc.poll() is None):
        if killed == "model" and s.proc.poll() is not None and not os.path.exists(f"/proc/{http}"):
            break
        time.sleep(0.1)
    out = s.close()
    assert not os.path.exists(f"/proc/{http}"), "the HTTP process outlived the model's"
    if killed == "http":
        assert s.proc.returncode == 1, out          # serving failed: said by the exit status


def test_one_process_serves_the_same(llama_dir):
    from bunsan.training.data import load_tokenizer
    s = Served(llama_dir[0], "--one-process")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == offline(llama_dir[1], load_tokenizer(None), "x = ", 8)
        children = open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children").read().split()
        assert not [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    finally:
        out = s.close()
    assert "the model in a process of its own" not in out
    # the paged decode kernel was built before serving (paged_decode.py), and said so
    assert "large decoding batches read their KV blocks in place (compiled)" in out, out
