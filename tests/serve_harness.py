"""A `bunsan serve` app on loopback for the serving tests: a tiny random Llama, the byte tokenizer, uvicorn
on a free port in a thread of the test process."""

from __future__ import annotations

import threading
import time

import httpx
import torch

from node_harness import free_port

PROMPTS = ["def f(x):", "import os", "a", "class Point:\n    def", "for i in range(10):", "# comment",
           "x = [1, 2,", "return"]


def wait_until_healthy(proc, url: str, what: str = "the server", timeout_s: float = 120) -> None:
    """Until a `bunsan serve` subprocess answers /health; its output if it exits first."""
    deadline = time.time() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, f"{what} did not start"
        time.sleep(0.3)


class Server:
    """`slots` x `context` of KV cache; `limits` are Limits' fields; `app` takes build_app's keywords."""

    def __init__(self, model, slots=3, context=96, grace_s=0.0, tokenizer=None, prefix_reuse=True, app=None,
                 num_blocks=None, **limits):
        from bunsan.training.data import load_tokenizer
        from bunsan.serve import Batcher, Limits, build_app
        from bunsan.serve.server import Server as Uvicorn
        self.tokenizer = tokenizer or load_tokenizer(None)
        self.batcher = Batcher(model, slots, context, prefix_reuse=prefix_reuse, num_blocks=num_blocks)
        self.app = build_app(self.batcher, self.tokenizer, "tiny", Limits(**limits), **(app or {}))
        self.port = free_port()
        self.server = Uvicorn(self.app, port=self.port, grace_s=grace_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, body, path="/v1/completions", **kw):
        return httpx.post(self.url + path, json=body, timeout=60, **kw)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)


def offline(model, tokenizer, prompt, n):
    """`bunsan generate`'s greedy text: what every greedy answer must equal."""
    from bunsan.models import generate
    ids = torch.tensor([tokenizer.encode(prompt)])
    return tokenizer.decode(generate(model, ids, n)[0, ids.shape[1]:].tolist())


def run_until_done(batcher, finished: list, count: int, timeout_s: float = 120) -> None:
    """Run `batcher` on a thread until `count` requests reported to `finished`, then stop it; every one must
    have ended at its token budget ("length")."""
    worker = threading.Thread(target=batcher.run)
    worker.start()
    deadline = time.time() + timeout_s
    try:
        while len(finished) < count and time.time() < deadline:
            worker.join(0.05)
    finally:
        batcher.stop()
        worker.join()
    assert finished == ["length"] * count, finished
