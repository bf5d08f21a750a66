"""`bunsan serve` in two processes (vLLM's split of its API server from its engine core): this one holds the
model and runs the batcher on its main thread; a child process runs the HTTP server (engine_client.py). The
event loop's Python (parsing, templates, detokenizing, streaming every token) then never holds the batcher's
interpreter lock between two of its kernels: in one process, a busy event loop stalled each step of the model
for as long as it ran.

    HTTP process -> here:   submit (a sequence: ids, sampling, grammar, adapter, images), cancel, hidden (an
                            embedding's input), lora_add / lora_remove, stop
    here -> HTTP process:   events after every loop of the batcher (tokens, ends, prompt log-probabilities,
                            hidden states) with the batcher's counters; fatal; stopped

Under tensor parallelism this is rank 0 (its batcher leads the other ranks' forwards). SIGTERM or SIGINT
here is passed to the HTTP process, which drains its requests as one process does (server.py), then tells
the batcher to stop; the HTTP process leaves when this one goes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections import deque

import torch

from bunsan.serve.sampling import RowSampler
from bunsan.serve.sequence import Request


def model_facts(batcher) -> dict:
    """What the HTTP process knows of the model and the cache (it never loads the weights)."""
    model, adapters = batcher.model, batcher.adapters
    return {"config": model.config, "architecture": getattr(model, "architecture", type(model).__name__),
            "parameters": [(tuple(p.shape), p.dtype) for p in model.parameters()],
            "composite": getattr(model, "composite", None), "image_token_id": getattr(model, "image_token_id", None),
            "cache_bytes": batcher.cache.nbytes, "cache_device": str(batcher.cache.device),
            "slots": batcher.slots, "max_len": batcher.max_len, "block_size": batcher.pool.block_size,
            "usable": batcher.pool.usable, "tensor_parallel": batcher.leader is not None,
            "adapters": None if adapters is None else adapter_state(adapters)}


def adapter_state(adapters) -> dict:
    return {"capacity": adapters.capacity, "max_rank": adapters.max_rank, "slots": dict(adapters.slots),
            "roots": dict(adapters.roots), "paths": dict(adapters.paths)}


def counters(batcher) -> dict:
    running, waiting = batcher.load()
    return {"running": running, "waiting": waiting, "free": batcher.pool.available(), "steps": batcher.steps,
            "preempted": batcher.preempted, "reused": batcher.reused_tokens, "loops": batcher.loops,
            "busy": batcher.busy_s, "forward": batcher.forward_s}


class Engine:
    """The model's side: the HTTP process's messages turned into the batcher's requests, and what the batcher
    reports sent back once per loop."""

    def __init__(self, batcher, tokenizer, conn):
        self.batcher, self.tokenizer, self.conn = batcher, tokenizer, conn
        self.send_lock = threading.Lock()
        self.outbox: deque = deque()          # (id, kind, value), from the batcher's thread
        self.requests: dict[int, Request] = {}
        self.media: dict[int, list] = {}      # a prompt's images: [Media, sequences still holding it]
        self.media_lock = threading.Lock()
        self.grammar_tokenizer = None
        self.closed = False                   # the HTTP process is gone
        batcher.after_loop = self.flush
        previous = batcher.on_fatal

        def fatal(message: str) -> None:
            self._send(("fatal", message))
            if previous is not None:
                previous(message)
        batcher.on_fatal = fatal

    def _send(self, message) -> None:
        if self.closed:
            return
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError):
            self.closed = True
            self.batcher.stop()

    def flush(self) -> None:
        """The events of the loop that just ran, with the batcher's counters (on the batcher's thread)."""
        if self.outbox:
            events = [self.outbox.popleft() for _ in range(len(self.outbox))]
            self._send(("events", events, counters(self.batcher)))

    def run(self) -> None:
        """The batcher's loop, until stopped; then the HTTP side hears that it stopped (and why, if it failed)."""
        with torch.no_grad():
            self.batcher.run()
        self._send(("stopped", self.batcher.fatal))

    def listen(self) -> None:
        """The HTTP process's messages, until it stops the batcher or goes away (its own thread)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.closed = True
                break
            if message[0] == "stop":
                break
            try:
                getattr(self, f"_on_{message[0]}")(*message[1:])
            except Exception as e:        # one message's failure is its sender's: this thread goes on listening
                self._refuse(message, f"{type(e).__name__}: {e}")
        self.batcher.stop()

    def _refuse(self, message, error: str) -> None:
        kind, key = message[0], message[1] if len(message) > 1 else None
        if kind.startswith("lora_"):
            self._send(("reply", key, False, error))
        elif kind == "hidden":
            self.outbox.append((key, "hidden", (False, error)))
        elif kind == "submit":
            self.outbox.append((key, "end", f"error: {error}"))
        self.batcher.wake.set()

    def _on_submit(self, rid: int, work: dict) -> None:
        r = self._request(rid, work)          # (a failure here: _refuse ends it)
        self.requests[rid] = r
        try:
            self.batcher.submit(r)
        except Exception as e:
            r.finish(f"error: {type(e).__name__}: {e}")
            self.batcher.wake.set()

    def _request(self, rid: int, work: dict) -> Request:
        key = work["media_key"]
        sampler = None
        if work["params"] is not None:
            constraint = None
            if work["grammar"] is not None:
                from bunsan.serve.structured import Constraint
                constraint = Constraint(self._grammar_tokenizer(), work["grammar"])
            sampler = RowSampler(work["params"], work["ids"], self.batcher.model.config.vocab_size, constraint)

        def finish(reason: str) -> None:
            self._ended(rid, key)
            self.outbox.append((rid, "end", reason))
        media = None
        if key is not None:              # (the last step: a failure above holds no image)
            with self.media_lock:
                if key not in self.media and work["media"] is None:
                    raise ValueError("the prompt's images did not reach the model's process")
                held = self.media.setdefault(key, [work["media"], 0])
                held[1] += 1
                media = held[0]
        return Request(ids=work["ids"], max_tokens=work["max_tokens"], finish=finish, sampler=sampler,
                       emit=lambda token: self.outbox.append((rid, "token", token)), eos=work["eos"],
                       prompt_logprobs=work["prompt_logprobs"], adapter=work["adapter"], root=work["root"],
                       on_prompt=lambda tokens: self.outbox.append((rid, "prompt", tokens)),
                       media=media)

    def _ended(self, rid: int, key: int | None) -> None:
        self.requests.pop(rid, None)
        with self.media_lock:            # (ends come on the batcher's thread, submissions on the listener's)
            if key is not None and key in self.media:
                self.media[key][1] -= 1
                if self.media[key][1] <= 0:
                    del self.media[key]

    def _grammar_tokenizer(self):
        """Structured outputs' view of the vocabulary, built at the first request with a grammar."""
        if self.grammar_tokenizer is None:
            from bunsan.serve.structured import grammar_tokenizer
            t = self.tokenizer
            ends = set(getattr(t, "stop_ids", None) or []) | ({t.eos_token_id} - {None})
            self.grammar_tokenizer = grammar_tokenizer(t, self.batcher.model.config.vocab_size, sorted(ends))
        return self.grammar_tokenizer

    def _on_cancel(self, rid: int) -> None:
        r = self.requests.get(rid)
        if r is not None:
            r.cancelled = True
            self.batcher.wake.set()

    def _on_hidden(self, hid: int, ids: list[int]) -> None:
        def done(future) -> None:
            error = future.exception()
            self.outbox.append((hid, "hidden", (False, str(error)) if error else (True, future.result())))
        self.batcher.hidden(ids).add_done_callback(done)

    def _on_lora_add(self, cid: int, name: str, path: str) -> None:
        adapters = self.batcher.adapters
        try:
            adapters.add(name, path)
        except ValueError as e:           # (its own words: the HTTP side shows them as they are)
            return self._send(("reply", cid, False, str(e)))
        self._send(("reply", cid, True, adapter_state(adapters)))

    def _on_lora_remove(self, cid: int, name: str) -> None:
        self.batcher.adapters.remove(name)
        self._send(("reply", cid, True, adapter_state(self.batcher.adapters)))


class HttpProcess:
    """The HTTP server's process, started before the model loads (its imports run meanwhile); `serve` hands it
    what to serve. If this process fails before, the child sees its pipe close and leaves quietly."""

    def __init__(self, http_main):
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.child = ctx.Process(target=_http_child, args=(http_main, there), name="bunsan-serve-http")
        self.child.start()
        there.close()

    def serve(self, batcher, tokenizer, http_args: tuple, join_s: float = 30.0) -> int:
        """The batcher runs here until the HTTP process stops it or goes away; exit status 1 if serving failed."""
        self.conn.send((model_facts(batcher), http_args))
        return _run(batcher, Engine(batcher, tokenizer, self.conn), self.child, join_s)


def _run(batcher, engine: Engine, child, join_s: float) -> int:
    forwarded = []

    def pass_on(signum, _frame) -> None:     # the HTTP process drains its requests, then stops the batcher
        forwarded.append(signum)
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGTERM)
    old = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGINT)}
    listener = threading.Thread(target=engine.listen, name="bunsan-engine-inbox", daemon=True)
    listener.start()
    try:
        engine.run()
        child.join(join_s)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if child.is_alive():
            child.terminate()
            child.join(5)
    return 1 if batcher.fatal or (engine.closed and not forwarded and child.exitcode) else 0


def _http_child(http_main, conn) -> None:
    # (in the model's session, so the kernel's per-session CPU share (autogroup) counts the two as one job; a
    # terminal's Ctrl-C reaches both: the HTTP server leaves SIGINT to the model's process, which passes it on)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import bunsan.serve.app  # noqa: F401  (the server's imports, while the model's process loads the model)
    try:
        facts, http_args = conn.recv()
    except (EOFError, OSError):           # the model's process failed to start: it says why
        raise SystemExit(0) from None
    raise SystemExit(http_main(conn, facts, *http_args))
