"""`bunsan serve`'s HTTP side: an OpenAI-style completions endpoint and a health check on Starlette.

The batcher runs on a thread of its own; each request gets an asyncio queue that the batcher's callbacks
fill from that thread (call_soon_threadsafe), so a slow reader only lets its own queue grow and a dropped
connection cancels its request. Bad input is a 4xx whose message names the field, the rule and the fix
(requests.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bunsan.serve.batcher import Batcher, Request
from bunsan.serve.requests import Completion, Limits, Refused, error_response, read_completion

class TextStream:
    """Token ids to text deltas; stops at the first stop string (which is not sent).

    Decodes incrementally: ids[:r] are text already (`text_r`); each token decodes only ids[p:], with ids[p:r]
    as context (a tokenizer may spell a token differently at the start of a text), so a long completion costs
    linear, not quadratic, decoding.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop, self.ids, self.sent, self.stopped = tokenizer, stop, [], "", False
        self.text_r, self.p, self.r = "", 0, 0

    def _decode(self) -> str:
        """The text of all ids so far."""
        window = self.tokenizer.decode(self.ids[self.p:])
        prior = self.tokenizer.decode(self.ids[self.p:self.r])
        if window.startswith(prior):
            text = self.text_r + window[len(prior):]
        else:                                   # the context changed its own spelling: decode everything
            text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):        # whole characters: the next token starts from here
            self.text_r, self.p, self.r = text, self.r, len(self.ids)
        return text

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode()
        tail = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))   # where a stop can start
        cut = min((i for i in (text.find(s, tail) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, text = True, text[:cut]
        else:
            text = text.rstrip("\ufffd")       # a character still being spelled by its bytes: hold it back
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]     # what may be the start of a stop string waits for the next token
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = max(text, self.sent, key=len)
        return delta

    def rest(self) -> str:
        text = self._decode() if not self.stopped else self.sent
        delta, self.sent = text[len(self.sent):], text
        return delta


class Job:
    """One accepted request: the batcher's work, the queue its callbacks fill from the batcher's thread (("text",
    delta) per token, then ("end", reason)), the text decoded so far, and the response's id."""

    def __init__(self, req: Completion, ids: list[int], tokenizer, model_name: str, on_release):
        self.ids, self.model_name, self.on_release = ids, model_name, on_release
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.text = TextStream(tokenizer, req.stop_strings())
        self.counted = True
        self.work = Request(ids=ids, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                            top_p=req.top_p, eos=tokenizer.eos_token_id, seed=req.seed, emit=self._emit,
                            finish=self._finish)
        self.rid, self.created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

    def _emit(self, token: int) -> None:     # on the batcher's thread: decode there, the event loop only sends
        delta = self.text.add(token)
        if self.text.stopped:
            self.work.cancelled = True
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", delta))

    def _finish(self, reason: str) -> None:  # on the batcher's thread too
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("end", reason))
        self.loop.call_soon_threadsafe(self.release)

    def release(self) -> None:
        """Leave the open count once, whichever comes first: the batcher's end or the response's."""
        if self.counted:
            self.counted = False
            self.on_release()

    def close(self) -> None:
        """The response is done (or its client went away): the batcher frees the slot at its next step."""
        self.work.cancelled = True
        self.release()

    def chunk(self, delta: str, reason: str | None) -> dict:
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.model_name,
                "choices": [{"text": delta, "index": 0, "logprobs": None, "finish_reason": reason}]}


def finish_reason(end: str) -> str:
    """OpenAI's finish_reason for the batcher's end: a stop string and a cancelled request both read "stop"."""
    return "stop" if end in ("stop", "cancelled") else end


def stream_response(job: Job) -> StreamingResponse:
    """Server-sent events: a chunk per non-empty delta, a last chunk with the finish reason (or the error), then
    [DONE]."""
    async def events():
        try:
            while True:
                kind, value = await job.queue.get()
                if kind == "text":
                    if value:
                        yield f"data: {json.dumps(job.chunk(value, None))}\n\n"
                    continue
                tail = job.text.rest() if value in ("length", "stop") else ""
                if value.startswith("error"):
                    yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                else:
                    yield f"data: {json.dumps(job.chunk(tail, finish_reason(value)))}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            job.close()
    return StreamingResponse(events(), media_type="text/event-stream")


async def whole_response(job: Job) -> JSONResponse:
    """The whole completion in one body, with its token usage; a failed forward is a 500."""
    out = []
    try:
        while True:
            kind, value = await job.queue.get()
            if kind == "text":
                out.append(value)
                continue
            break
    finally:
        job.close()
    if value.startswith("error"):
        return error_response(500, value.removeprefix("error: "), "server_error")
    out.append(job.text.rest())
    body = job.chunk("".join(out), finish_reason(value))
    generated = job.work.generated
    body["usage"] = {"prompt_tokens": len(job.ids), "completion_tokens": generated,
                     "total_tokens": len(job.ids) + generated}
    return JSONResponse(body)


class Service:
    """The endpoints over one batcher and the thread it runs on."""

    def __init__(self, batcher: Batcher, tokenizer, model_name: str, limits: Limits):
        self.batcher, self.tokenizer, self.model_name, self.limits = batcher, tokenizer, model_name, limits
        self.worker = threading.Thread(target=batcher.run, name="bunsan-batcher", daemon=True)
        self.open_requests = 0     # accepted and not yet fully answered (the event loop's own count: no lock)

    def alive(self) -> bool:
        return self.worker.is_alive() and not self.batcher.stopped

    async def health(self, _: HTTPRequest) -> JSONResponse:
        active, waiting = self.batcher.load()
        alive = self.alive()
        return JSONResponse({"status": "ok" if alive else "stopped", "model": self.model_name, "active": active,
                             "waiting": waiting, "slots": len(self.batcher.cache.lengths),
                             "context": self.batcher.max_len}, status_code=200 if alive else 503)

    def admit(self) -> None:
        """Refuse a valid request the server cannot take now: too many open (429), or no worker (503)."""
        if self.open_requests >= self.limits.max_concurrent:
            raise Refused(429, f"{self.limits.max_concurrent} requests are already running or waiting; retry later",
                          "rate_limit_error")
        if not self.alive():
            raise Refused(503, "the model worker has stopped; the server is shutting down", "server_error")

    def _release(self) -> None:
        self.open_requests -= 1

    async def completions(self, http: HTTPRequest):
        try:
            req, ids = await read_completion(http, self.limits, self.tokenizer, self.batcher.max_len)
            self.admit()
        except Refused as refused:
            return refused.response()
        job = Job(req, ids, self.tokenizer, self.model_name, self._release)
        self.batcher.submit(job.work)
        # the batcher's finish releases through the event loop, so never before this count, even if it ends at once
        self.open_requests += 1
        return stream_response(job) if req.stream else await whole_response(job)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        self.worker.start()
        try:
            yield
        finally:                       # requests still running are told the server is going away
            self.batcher.stop()
            self.worker.join(timeout=10)


def build_app(batcher: Batcher, tokenizer, model_name: str, limits: Limits | None = None) -> Starlette:
    service = Service(batcher, tokenizer, model_name, limits or Limits())
    routes = [Route("/health", service.health),
              Route("/v1/completions", service.completions, methods=["POST"])]
    return Starlette(routes=routes, lifespan=service.lifespan)
