"""The HTTP process's side of `bunsan serve`'s two processes (engine.py): an EngineClient stands where the
Batcher stands in one process (app.py's Service takes either). Requests go to the model's process as data;
what comes back once per loop (tokens, ends, counters) is handed to each request's callbacks on the reader
thread, as the batcher's own thread hands them over in one process (jobs.py puts them on the event loop).

A request cancelled here (a stop string, a client gone) is told to the model's process at the next message,
or within 0.1 s when none comes."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from bunsan.serve.errors import ApiError
from bunsan.serve.sequence import Request, check_embeddable, check_fits

POLL_S = 0.1
REPLY_S = 120.0


class ModelFacts:
    """The served model as the HTTP side reads it: its config, its parameters' shapes and dtypes (meta tensors:
    no memory), whether it reads images."""

    def __init__(self, facts: dict):
        self.config, self.architecture = facts["config"], facts["architecture"]
        self.composite, self.image_token_id = facts["composite"], facts["image_token_id"]
        self._parameters = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in facts["parameters"]]

    def parameters(self):
        return iter(self._parameters)


class _Pool:
    def __init__(self, block_size: int, usable: int):
        self.block_size, self.usable, self.free = block_size, usable, usable

    def available(self) -> int:
        return self.free


class RemoteAdapters:
    """The model process's LoRA adapters (lora.AdapterSet) as the HTTP side names them; loading and unloading
    run there, answered within REPLY_S."""

    def __init__(self, state: dict, client: "EngineClient"):
        self.client = client
        self.capacity, self.max_rank = state["capacity"], state["max_rank"]
        self._take(state)

    def _take(self, state: dict) -> None:
        self.slots, self.roots, self.paths = state["slots"], state["roots"], state["paths"]

    def add(self, name: str, path: str) -> None:
        self._take(self.client.call("lora_add", name, path))

    def remove(self, name: str) -> None:
        self._take(self.client.call("lora_remove", name))


class EngineClient:
    """What app.py's Service needs of a batcher, served by the model's process over `conn`."""

    def __init__(self, conn, facts: dict):
        self.conn, self.model = conn, ModelFacts(facts)
        self.slots, self.max_len = facts["slots"], facts["max_len"]
        self.pool = _Pool(facts["block_size"], facts["usable"])
        self.cache = SimpleNamespace(nbytes=facts["cache_bytes"], device=torch.device(facts["cache_device"]))
        self.leader = True if facts["tensor_parallel"] else None     # (only whether there is one is read)
        self.adapters = None if facts["adapters"] is None else RemoteAdapters(facts["adapters"], self)
        self.steps = self.preempted = self.reused_tokens = self.loops = 0
        self.busy_s = self.forward_s = 0.0
        self.running = self.waiting = 0
        self.fatal: str | None = None
        self.on_fatal = None
        self.stopped = False
        self.open: dict[int, Request] = {}          # submitted and not ended
        self.told: set[int] = set()                 # cancelled, and the model's process told so
        self.waiters: dict[int, Future] = {}        # hidden states and adapter calls under way
        self.ids = itertools.count()
        self.send_lock = threading.Lock()
        self.media_keys: dict[int, object] = {}     # a prompt's images go over once for all its sequences

    def _send(self, *message) -> None:
        with self.send_lock:
            self.conn.send(message)

    def _send_or_503(self, *message) -> None:
        """A request's message; the model's process gone (its reader not yet aware) is a 503, never a 500."""
        try:
            if self.stopped:
                raise OSError("stopped")
            self._send(*message)
        except (OSError, ValueError):
            self.open.pop(message[1], None)
            self.waiters.pop(message[1], None)
            raise ApiError(503, "the model's process has stopped; the server is shutting down") from None

    def submit(self, r: Request) -> None:
        check_fits(len(r.ids), r.max_tokens, self.max_len, self.pool.block_size, self.pool.usable)
        rid = next(self.ids)
        sampler = r.sampler
        constraint = getattr(sampler, "constraint", None)
        key = None if r.media is None else id(r.media)
        first = key is not None and self.media_keys.get(key) is not r.media
        if key is not None:
            self.media_keys[key] = r.media
        self.open[rid] = r
        self._send_or_503("submit", rid, {
            "ids": r.ids, "max_tokens": r.max_tokens, "eos": r.eos, "prompt_logprobs": r.prompt_logprobs,
            "adapter": r.adapter, "root": r.root, "params": None if sampler is None else sampler.params,
            "grammar": None if constraint is None else constraint.grammar, "media_key": key,
            "media": r.media if first else None})

    def hidden(self, ids: list[int]) -> Future:
        check_embeddable(len(ids), self.max_len, self.leader is not None)
        hid = next(self.ids)
        self.waiters[hid] = done = Future()
        self._send_or_503("hidden", hid, ids)
        return done

    def call(self, kind: str, *args):
        """A synchronous call to the model's process (adapters); its ValueError raised here."""
        cid = next(self.ids)
        self.waiters[cid] = done = Future()
        self._send(kind, cid, *args)
        ok, value = done.result(REPLY_S)
        if not ok:
            raise ValueError(value)
        return value

    def load(self) -> tuple[int, int]:
        return self.running, self.waiting

    def stop(self) -> None:
        if not self.stopped:
            try:
                self._send("stop")
            except (OSError, ValueError):
                pass

    def run(self) -> None:
        """Until the model's process says it stopped (or goes away): its messages dispatched here."""
        try:
            while True:
                if self.conn.poll(POLL_S):
                    message = self.conn.recv()
                    if message[0] == "stopped":
                        self.fatal = self.fatal or message[1]
                        break
                    self._dispatch(message)
                self._tell_cancelled()
        except (EOFError, OSError):
            self._fail("the model's process ended")
        except BaseException as e:      # the reader's own failure ends serving too, never leaves it deaf
            self._fail(f"the HTTP side's reader failed: {type(e).__name__}: {e}")
            raise
        finally:
            self.stopped = True
            reason = f"error: {self.fatal}" if self.fatal else "error: the server is shutting down"
            for r in list(self.open.values()):
                r.finish(reason)
            self.open.clear()
            for waiter in self.waiters.values():
                waiter.set_exception(RuntimeError(reason.removeprefix("error: ")))

    def _fail(self, message: str) -> None:
        if self.fatal is None:
            self.fatal = message
            if self.on_fatal is not None:
                self.on_fatal(message)

    def _dispatch(self, message) -> None:
        kind = message[0]
        if kind == "fatal":
            return self._fail(message[1])
        if kind == "reply":
            _, cid, ok, value = message
            self.waiters.pop(cid).set_result((ok, value))
            return
        _, events, counts = message
        self.running, self.waiting, self.pool.free = counts["running"], counts["waiting"], counts["free"]
        self.steps, self.preempted, self.reused_tokens = counts["steps"], counts["preempted"], counts["reused"]
        self.loops, self.busy_s, self.forward_s = counts["loops"], counts["busy"], counts["forward"]
        for rid, what, value in events:
            if what == "token":
                self.open[rid].emit(value)
            elif what == "end":
                r = self.open.pop(rid)
                self.told.discard(rid)
                if r.media is not None and not any(o.media is r.media for o in list(self.open.values())):
                    self.media_keys.pop(id(r.media), None)
                r.finish(value)
            elif what == "prompt":
                self.open[rid].on_prompt(value)
            elif what == "hidden":
                ok, state = value
                waiter = self.waiters.pop(rid)
                waiter.set_result(state) if ok else waiter.set_exception(RuntimeError(state))

    def _tell_cancelled(self) -> None:
        for rid, r in list(self.open.items()):      # (a copy: the event loop's thread adds to it)
            if r.cancelled and rid not in self.told:
                self.told.add(rid)
                self._send("cancel", rid)

