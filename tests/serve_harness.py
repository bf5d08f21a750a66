"""`bunsan serve` for the serving tests: in this process (a tiny random Llama and the byte tokenizer, or a
checkpoint loaded by the command's own code) with uvicorn on a free port in a thread; or started as a user
starts it, a process of its own (`Launched`).

No wait here is a deadline on how fast the machine is: each waits for an event (the port answers /health,
the process exited, the requests finished) and fails at once when the thing waited on cannot happen any more
(the process or thread ended: its output says why). CEILING_S only stops a real hang."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
import torch

from node_harness import free_port

PROMPTS = ["def f(x):", "import os", "a", "class Point:\n    def", "for i in range(10):", "# comment",
           "x = [1, 2,", "return"]
# Nothing that works takes this long even on a machine shared with several suites; under pytest-timeout's 300 s
# a test (pyproject.toml), so that a hang is named here, with what the server said, before that kills the test.
CEILING_S = 270.0
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# one TLS context for every request here (over plain HTTP it is never used): httpx otherwise builds one per call,
# 25 ms of CPU, as much as a tiny model's answer
_TLS = ssl.create_default_context()


def http_post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, verify=_TLS, **{"timeout": CEILING_S, **kw})


def http_get(url: str, **kw) -> httpx.Response:
    return httpx.get(url, verify=_TLS, **{"timeout": CEILING_S, **kw})


def http_stream(method: str, url: str, **kw):
    return httpx.stream(method, url, verify=_TLS, **{"timeout": CEILING_S, **kw})


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's intra-op threads at one while a module that imports this runs, then as they were: its models are
    tiny, and two threads on cores shared with other work wait for each other at every op (a minute of
    generation under load that one thread does in a second)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def wait_for(condition, what: str, alive=lambda: True, why=lambda: "", ceiling_s: float = CEILING_S,
             every_s: float = 0.02) -> None:
    """Until `condition()` (asked every `every_s`); fails at once with `why()` when `alive()` says it can no
    longer come true."""
    give_up = time.monotonic() + ceiling_s
    while not condition():
        if not alive():
            if condition():         # (it came true as its source ended)
                return
            pytest.fail(f"{what}: it can no longer happen\n{why()}")
        if time.monotonic() > give_up:
            pytest.fail(f"{what}: not after {ceiling_s:.0f} s, a hang\n{why()}")
        time.sleep(every_s)


def _healthy(url: str) -> bool:
    try:
        return http_get(url + "/health", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def wait_until_healthy(proc, url: str, what: str = "the server", output=None) -> None:
    """Until a `bunsan serve` subprocess answers /health; if it exits first, fail at once with its output
    (`output()`, else its stdout pipe)."""
    def said() -> str:
        if output is not None:
            return output()
        try:
            return proc.communicate(timeout=30)[0] or ""
        except (subprocess.TimeoutExpired, ValueError):     # (a child still holds the pipe)
            return "(its output could not be read)"
    wait_for(lambda: _healthy(url), f"{what} answering /health", lambda: proc.poll() is None,
             lambda: f"exit status {proc.poll()}; its output:\n{said()}", every_s=0.25)


class Launched:
    """`bunsan serve ARGS` started as a user starts it, its output kept in a file (a pipe nobody reads can fill
    and stall it; `pipe=True` where the test itself closes the reader). `wait=False`: `ready()` waits later (so
    that several start together)."""

    def __init__(self, *args, what: str = "bunsan serve", env=None, pipe: bool = False, wait: bool = True,
                 **popen):
        self.port, self.what, self.healthy = free_port(), what, False
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = None if pipe else tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "bunsan.cli", "serve", *map(str, args), "--port",
                                      str(self.port)], env=env or ENV, stdout=subprocess.PIPE if pipe else self.log,
                                     stderr=subprocess.STDOUT, text=True, **popen)
        self._out = ""
        if wait:
            self.ready()

    def ready(self) -> "Launched":
        """Until it answers /health (once: later calls return at once)."""
        if not self.healthy:
            try:
                wait_until_healthy(self.proc, self.url, self.what, None if self.log is None else self.output)
            except BaseException:
                self.close(kill=True)
                raise
            self.healthy = True
        return self

    def output(self) -> str:
        if self.log is None:
            return self._out
        self.log.seek(0)
        return self.log.read()

    def close(self, kill: bool = False) -> str:
        """Stop it (SIGTERM, or SIGKILL) if still running, wait for it to end; everything it printed."""
        if self.proc.poll() is None and kill:
            self.proc.kill()
        elif self.proc.poll() is None:
            self.proc.terminate()
        if self.log is None:
            if not self.proc.stdout.closed:
                self._out = self.proc.communicate(timeout=CEILING_S)[0]
            self.proc.wait(CEILING_S)
        else:
            self.proc.wait(CEILING_S)
        return self.output()


def selected(request, *names: str) -> bool:
    """Whether a test of `request`'s module named `names` (functions) is among those about to run: a fixture
    launches its server early only for a test that will take it."""
    return any(item.module is request.module and getattr(item, "originalname", item.name) in names
               for item in request.session.items)


class Server:
    """`slots` x `context` of KV cache; `limits` are Limits' fields; `app` takes build_app's keywords."""

    def __init__(self, model, slots=3, context=96, grace_s=0.0, tokenizer=None, prefix_reuse=True, app=None,
                 num_blocks=None, **limits):
        from bunsan.training.data import load_tokenizer
        from bunsan.serve import Batcher, Limits, build_app
        self.tokenizer = tokenizer or load_tokenizer(None)
        self.batcher = Batcher(model, slots, context, prefix_reuse=prefix_reuse, num_blocks=num_blocks)
        self.app = build_app(self.batcher, self.tokenizer, "tiny", Limits(**limits), **(app or {}))
        self._start(grace_s)

    @classmethod
    def of_command(cls, *argv) -> "Server":
        """`bunsan serve ARGV` in this process, built by cli/serve.py's own steps for one process without
        --tp (the checkpoint loaded, its layers prepacked on the CPU, the KV cache sized, adapters, the app):
        for tests of what it answers, not of how it starts. `banner`: its images line."""
        from bunsan.cli import serve as cli
        from bunsan.cli.main import build_parser
        from bunsan.serve import Batcher
        self = cls.__new__(cls)
        args = build_parser().parse_args(["serve", *map(str, argv)])
        assert args.tp == 1, "--tp starts processes: Launched"
        model, self.tokenizer, name, context = cli.load_model(args)
        lora = args.lora_modules or args.allow_runtime_lora
        if all(p.device.type == "cpu" for p in model.parameters()) and not lora:
            from bunsan.serve.cpu_linear import pack_linears, packable
            if packable(model):
                pack_linears(model, rows=min(64, args.slots if isinstance(args.slots, int) else 64))
        slots, blocks, _ = cli.cache_size(args, model, context, None)
        self.batcher = Batcher(model, slots, context, prefix_reuse=not args.no_prefix_reuse, num_blocks=blocks,
                               block_size=args.block_size, adapters=cli.lora_adapters(args, model))
        self.app, _, self.banner = cli.serve_app(args, model, self.tokenizer, name, context, self.batcher)
        self._start(args.shutdown_grace, args.keep_alive_timeout)
        return self

    def _start(self, grace_s: float, keep_alive_s: float | None = None) -> None:
        from bunsan.serve.server import Server as Uvicorn
        self.port = free_port()
        self.server = Uvicorn(self.app, port=self.port, grace_s=grace_s,
                              **({} if keep_alive_s is None else {"keep_alive_s": keep_alive_s}))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "uvicorn listening", self.thread.is_alive,
                 lambda: "its thread ended (the error is above)")
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, body, path="/v1/completions", **kw):
        return http_post(self.url + path, json=body, **kw)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=CEILING_S)


def offline(model, tokenizer, prompt, n):
    """`bunsan generate`'s greedy text: what every greedy answer must equal."""
    from bunsan.models import generate
    ids = torch.tensor([tokenizer.encode(prompt)])
    return tokenizer.decode(generate(model, ids, n)[0, ids.shape[1]:].tolist())


def run_until_done(batcher, finished: list, count: int) -> None:
    """Run `batcher` on a thread until `count` requests reported to `finished`, then stop it; every one must
    have ended at its token budget ("length")."""
    worker = threading.Thread(target=batcher.run)
    worker.start()
    try:
        wait_for(lambda: len(finished) >= count, f"{count} requests finished", worker.is_alive,
                 lambda: f"the batcher's thread ended: {batcher.fatal}; finished: {finished}")
    finally:
        batcher.stop()
        worker.join()
    assert finished == ["length"] * count, finished


def tp_serving_job(rank: int, argv: list, prompts: list[list[int]], n: int, idle_s: float = 0.0):
    """A pool job: `bunsan serve ARGV --tp WORLD`'s model side (cli/serve.py's _serve) on this rank: the
    checkpoint loaded and split by the command's own code, the sizes agreed, rank 0's batcher leading the
    others' forwards, idle `idle_s` first (heartbeats only). Rank 0's greedy tokens per prompt. (Not warmed:
    these batches are below the in-place kernel's size.)"""
    from bunsan.cli import serve as cli
    from bunsan.cli.main import build_parser
    from bunsan.inference.tp import split_over_ranks
    from bunsan.serve import Batcher, PagedCache
    from bunsan.serve.batcher import Request
    from bunsan.serve.tp import Leader, follow
    args = build_parser().parse_args(["serve", *map(str, argv)])
    model, _, _, context = cli.load_model(args)
    shard = split_over_ranks(model, args.tp, timeout_s=args.timeout)
    slots, blocks = cli._agreed(shard, *cli.cache_size(args, model, context, shard.kv_heads)[:2])
    if shard.rank != 0:
        follow(model, PagedCache(model, blocks, args.block_size, shard.kv_heads), shard.comm, shard.group,
               shard.device)
        return None
    batcher = Batcher(model, slots, context, shard.kv_heads, Leader(shard.comm, shard.group, shard.device),
                      num_blocks=blocks, block_size=args.block_size)
    worker = threading.Thread(target=batcher.run)
    worker.start()
    got, finished = [[] for _ in prompts], []
    try:
        time.sleep(idle_s)
        for i, p in enumerate(prompts):
            batcher.submit(Request(p, n, emit=lambda t, i=i: got[i].append(t.id), finish=finished.append))
        wait_for(lambda: len(finished) == len(prompts), "every prompt answered", worker.is_alive,
                 lambda: f"rank 0's batcher ended: {batcher.fatal}")
    finally:
        batcher.stop()                  # (its last message tells the others to stop following)
        worker.join()
    assert finished == ["length"] * len(prompts), (finished, batcher.fatal)
    return got
