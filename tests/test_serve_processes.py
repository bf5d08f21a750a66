"""`bunsan serve` in its two processes (serve/engine.py, engine_client.py), started as a user starts it: what
crosses between them arrives whole (a cancelled stream frees its blocks in the model's process, images reach
it once per prompt, a grammar is rebuilt there, adapters load there), and when either process goes, the
other does too instead of hanging; SIGTERM drains as in one process."""

# Servers launched (each a `bunsan serve` process, e2e), and the tests that share one (TAKES):
#   shared          answers, its cores bound; then SIGTERM drains it (the test that ends it)
#   free            --cpu-bind none: its cores left to the scheduler; then Ctrl-C drains it
#   model-killed    the model's process killed, the HTTP process must end
#   http-killed     the HTTP process killed, the model's process must end
#   one-process     --one-process: answers, no HTTP child, the decode kernel built
# Those the selected tests take start together, so their start-ups overlap on the cores instead of queueing;
# a test whose server another already ended gets a fresh one (any order passes). The cancelled sequence runs
# both sides over a pipe in this process.

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from parity import tiny_model  # noqa: E402
from serve_harness import CEILING_S, Launched, http_get, http_post, http_stream, offline, wait_for  # noqa: E402
from serve_harness import one_torch_thread  # noqa: E402,F401  (autouse: torch on one thread here)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from bunsan.models.hf import save_llama
    folder = tmp_path_factory.mktemp("llama")
    model = tiny_model(0).eval()
    save_llama(model.state_dict(), model.config, folder)
    return folder, model


FLAGS = {"shared": ("--slots", "4", "--shutdown-grace", "0.5"),
         "free": ("--slots", "4", "--shutdown-grace", "0.5", "--cpu-bind", "none"),
         "model-killed": (), "http-killed": (), "one-process": ("--one-process",)}
TAKES = {"test_answers_cross_the_processes_as_generate_gives_them": ("shared",),
         "test_the_models_threads_are_bound_to_their_cores_and_the_http_process_is_not": ("shared", "free"),
         "test_a_signal_drains_then_both_processes_end[sigterm]": ("shared",),
         "test_a_signal_drains_then_both_processes_end[ctrl-c]": ("free",),
         "test_when_one_process_dies_the_other_ends[model]": ("model-killed",),
         "test_when_one_process_dies_the_other_ends[http]": ("http-killed",),
         "test_one_process_serves_the_same": ("one-process",)}


class Served(Launched):
    def __init__(self, folder, key: str):
        # a session of its own, as a terminal's: Ctrl-C is its whole process group's SIGINT; the model-killed
        # one's output through a pipe, whose reader the test closes
        super().__init__("--checkpoint", folder, "--context", "96", *FLAGS[key], pipe=key == "model-killed",
                         wait=False, start_new_session=True, what=f"bunsan serve ({key})")

    def http_pid(self) -> int:
        """The HTTP process: the model's process's child that multiprocessing spawned."""
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        spawned = [int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(spawned) == 1, children
        return spawned[0]


@pytest.fixture(scope="module")
def served(request, llama_dir):
    """`served(key)`: that server, answering /health."""
    keys = {k for item in request.session.items if item.module is request.module for k in TAKES.get(item.name, ())}
    running = {k: Served(llama_dir[0], k) for k in sorted(keys)}

    def get(key: str) -> Served:
        s = running.get(key)
        if s is None or (s.healthy and s.proc.poll() is not None):
            running[key] = s = Served(llama_dir[0], key)
        return s.ready()
    yield get
    for s in running.values():
        s.close(kill=True)


@pytest.mark.e2e
def test_answers_cross_the_processes_as_generate_gives_them(served, llama_dir):
    from bunsan.training.data import load_tokenizer
    s = served("shared")
    model, tokenizer = llama_dir[1], load_tokenizer(None)
    prompts = ["def f(x):", "import os", "class A:"]
    for prompt in prompts:
        r = http_post(s.url + "/v1/completions", timeout=CEILING_S,
                      json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline(model, tokenizer, prompt, 10)
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"]) == 10
    embedded = http_post(s.url + "/v1/embeddings", json={"input": ["hello", "world"]},
                         timeout=CEILING_S).json()
    assert [len(d["embedding"]) for d in embedded["data"]] == [model.config.hidden_size] * 2
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    shaped = http_post(s.url + "/v1/chat/completions", timeout=CEILING_S, json={
        "messages": [{"role": "user", "content": "n"}], "max_tokens": 30, "temperature": 1, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).json()
    assert "choices" in shaped, shaped
    assert isinstance(json.loads(shaped["choices"][0]["message"]["content"])["n"], int)
    name = http_get(s.url + "/v1/models").json()["data"][0]["id"]
    show = http_post(s.url + "/api/show", json={"model": name}).json()
    assert show["model_info"]["general.parameter_count"] == sum(p.numel() for p in model.parameters())


def _cores(pid: int) -> set[str]:
    """Every thread's allowed CPUs (Cpus_allowed_list) of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = open(f"/proc/{pid}/task/{tid}/status").read()
        out.add(next(line.split(":")[1].strip() for line in status.splitlines()
                     if line.startswith("Cpus_allowed_list")))
    return out


@pytest.mark.e2e
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding leaves the HTTP process a core: needs two")
def test_the_models_threads_are_bound_to_their_cores_and_the_http_process_is_not(served):
    """--cpu-bind auto (the default): every thread of the model's process on the last cores this process may
    use, as many as its torch threads (--threads' default: all but one), the HTTP process on all of them;
    --cpu-bind none leaves both to the scheduler."""
    allowed = sorted(os.sched_getaffinity(0))
    model_cores = allowed[1:]
    want = f"{model_cores[0]}-{model_cores[-1]}" if len(model_cores) > 1 else str(model_cores[0])
    shared = served("shared")
    assert _cores(shared.proc.pid) == {want}
    everything = _cores(shared.http_pid())
    assert len(everything) == 1 and everything != {want}
    free = served("free")
    assert _cores(free.proc.pid) == _cores(free.http_pid()) == everything


def test_a_cancelled_sequence_stops_in_the_models_process(llama_dir):
    """The two sides over a pipe in this process, the model's forwards let through one at a time: a sequence
    cancelled on the HTTP side (a stop string, a client gone) while a forward is held ends in the model's
    process at its next step (the held one's token at most), its blocks back."""
    import multiprocessing

    from bunsan.serve.batcher import Batcher, Request
    from bunsan.serve.engine import Engine, model_facts
    from bunsan.serve.engine_client import EngineClient
    from bunsan.training.data import load_tokenizer
    batcher = Batcher(llama_dir[1], 2, 96)
    forward, permits = batcher._forward, threading.Semaphore(0)

    def held(*a):
        assert permits.acquire(timeout=CEILING_S), "no permit: the test hung"
        return forward(*a)
    batcher._forward = held
    here, there = multiprocessing.Pipe()
    engine = Engine(batcher, load_tokenizer(None), here)
    client = EngineClient(there, model_facts(batcher))
    threads = [threading.Thread(target=t, daemon=True) for t in (engine.listen, engine.run, client.run)]
    for t in threads:
        t.start()
    tokens, ended = [], []
    r = Request([5, 6, 7], 60, emit=tokens.append, finish=ended.append)
    try:
        client.submit(r)
        for _ in range(3):                  # the prefill and two decoding steps, then the fourth waits
            permits.release()
        wait_for(lambda: len(tokens) == 3, "three tokens back in the HTTP side", threads[1].is_alive)
        r.cancelled = True
        wait_for(lambda: all(q.cancelled for q in list(engine.requests.values())),
                 "the cancel reaching the model's side", threads[0].is_alive)
        for _ in range(60):
            permits.release()
        wait_for(lambda: ended, "the sequence ending", threads[2].is_alive)
        assert ended == ["cancelled"] and len(tokens) <= 4, (ended, len(tokens))
        wait_for(lambda: client.pool.available() == batcher.pool.usable, "the client hearing its blocks are back",
                 threads[2].is_alive)
        assert batcher.pool.available() == batcher.pool.usable
    finally:
        client.stop()
        for t in threads:
            t.join(CEILING_S)
    assert client.stopped and not batcher.running


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_signal_drains_then_both_processes_end(served, how):
    """SIGTERM to the model's process, or Ctrl-C (SIGINT to both): one graceful drain (a second signal would
    be uvicorn's forced exit), the running stream ends with its [DONE], both processes leave, status 0.
    (Each ends a shared server: the default one, the --cpu-bind none one.)"""
    s = served("shared" if how == "sigterm" else "free")
    http = s.http_pid()
    with http_stream("POST", s.url + "/v1/completions", timeout=CEILING_S,
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
    assert _gone(http)


def _gone(pid: int) -> bool:
    """Process `pid` has ended (a zombie its parent has not yet reaped has ended too)."""
    try:
        return "zombie" in open(f"/proc/{pid}/status").read().lower()
    except OSError:
        return True


@pytest.mark.e2e
@pytest.mark.parametrize("killed", ["model", "http"])
def test_when_one_process_dies_the_other_ends(served, killed):
    """Killed as a test harness or a supervisor kills it: its output's reader gone too (the HTTP process
    then cannot print why it stops, and stops all the same)."""
    s = served(f"{killed}-killed")
    http = s.http_pid()
    if killed == "model":
        s.proc.stdout.close()
    os.kill(s.proc.pid if killed == "model" else http, signal.SIGKILL)
    try:
        wait_for(lambda: s.proc.poll() is not None and _gone(http),
                 "both processes ended (a hang: the one left outlived the other)")
    finally:
        out = s.close(kill=True)
    if killed == "http":
        assert s.proc.returncode == 1, out          # serving failed: said by the exit status


@pytest.mark.e2e
def test_one_process_serves_the_same(served, llama_dir):
    from bunsan.training.data import load_tokenizer
    s = served("one-process")
    try:
        r = http_post(s.url + "/v1/completions", timeout=CEILING_S,
                      json={"prompt": "x = ", "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == offline(llama_dir[1], load_tokenizer(None), "x = ", 8)
        children = open(f"/proc/{s.proc.pid}/task/{s.proc.pid}/children").read().split()
        assert not [c for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    finally:
        out = s.close()
    assert "the model in a process of its own" not in out
    # the paged decode kernel was built before serving (paged_decode.py), and said so
    assert "large decoding batches read their KV blocks in place (compiled)" in out, out
