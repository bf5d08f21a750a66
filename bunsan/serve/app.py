"""`bunsan serve`'s HTTP side: an OpenAI-style completions endpoint and a health check on Starlette.

The batcher runs on a thread of its own; each request gets an asyncio queue that the batcher's callbacks
fill from that thread (call_soon_threadsafe), so a slow reader only lets its own queue grow and a dropped
connection cancels its request. Bad input is a 4xx whose message names the field, the rule and the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bunsan.serve.batcher import Batcher, Request


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024             # the most one request may ask for
    max_concurrent: int = 64           # requests running or waiting; beyond, 429


class Completion(BaseModel):
    model_config = ConfigDict(extra="ignore")          # OpenAI clients send fields bunsan does not use
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_k: int | None = Field(None, ge=1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None
    model: str | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _explain(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


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


def build_app(batcher: Batcher, tokenizer, model_name: str, limits: Limits | None = None) -> Starlette:
    limits = limits or Limits()
    worker = threading.Thread(target=batcher.run, name="bunsan-batcher", daemon=True)
    open_requests = [0]        # accepted and not yet fully answered (the event loop's own count: no lock)

    async def health(_: HTTPRequest) -> JSONResponse:
        active, waiting = batcher.load()
        alive = worker.is_alive() and not batcher.stopped
        return JSONResponse({"status": "ok" if alive else "stopped", "model": model_name, "active": active,
                             "waiting": waiting, "slots": len(batcher.cache.lengths),
                             "context": batcher.max_len}, status_code=200 if alive else 503)

    async def completions(http: HTTPRequest):
        size = http.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            return _error(413, f"request body of {size} bytes exceeds the limit of {limits.max_body_bytes}; "
                               "send a shorter prompt (or raise --max-body-bytes)")
        body = await http.body()
        if len(body) > limits.max_body_bytes:
            return _error(413, f"request body of {len(body)} bytes exceeds the limit of {limits.max_body_bytes}")
        try:
            req = Completion.model_validate(json.loads(body))
        except json.JSONDecodeError as e:
            return _error(400, f"the body is not JSON ({e}); send {{\"prompt\": \"...\", \"max_tokens\": 16}}")
        except ValidationError as e:
            return _error(400, _explain(e))
        if req.max_tokens > limits.max_tokens:
            return _error(400, f"max_tokens {req.max_tokens} exceeds this server's limit of {limits.max_tokens}; "
                               "ask for fewer")
        ids = tokenizer.encode(req.prompt)
        if len(ids) + req.max_tokens > batcher.max_len:
            return _error(400, f"prompt of {len(ids)} tokens + max_tokens {req.max_tokens} exceeds the context of "
                               f"{batcher.max_len} tokens; shorten the prompt or ask for fewer tokens")
        if open_requests[0] >= limits.max_concurrent:
            return _error(429, f"{limits.max_concurrent} requests are already running or waiting; retry later",
                          "rate_limit_error")
        if not worker.is_alive() or batcher.stopped:
            return _error(503, "the model worker has stopped; the server is shutting down", "server_error")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        text = TextStream(tokenizer, [s for s in stop if s])
        counted = [True]

        def release() -> None:        # once, whichever comes first: the batcher's end or the response's
            if counted[0]:
                counted[0] = False
                open_requests[0] -= 1

        def finish(reason: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("end", reason))
            loop.call_soon_threadsafe(release)
        work = Request(ids=ids, max_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                       top_p=req.top_p, eos=tokenizer.eos_token_id, seed=req.seed, emit=None, finish=finish)

        def emit(token: int) -> None:      # on the batcher's thread: decode there, the event loop only sends
            delta = text.add(token)
            if text.stopped:
                work.cancelled = True
            loop.call_soon_threadsafe(queue.put_nowait, ("text", delta))
        work.emit = emit
        batcher.submit(work)
        open_requests[0] += 1
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(delta: str, reason: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"text": delta, "index": 0, "logprobs": None, "finish_reason": reason}]}

        if req.stream:
            async def events():
                try:
                    while True:
                        kind, value = await queue.get()
                        if kind == "text":
                            if value:
                                yield f"data: {json.dumps(chunk(value, None))}\n\n"
                            continue
                        tail = text.rest() if value in ("length", "stop") else ""
                        reason = "stop" if value in ("stop", "cancelled") else value
                        if value.startswith("error"):
                            yield f"data: {json.dumps({'error': {'message': value, 'type': 'server_error'}})}\n\n"
                        else:
                            yield f"data: {json.dumps(chunk(tail, reason))}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                finally:
                    work.cancelled = True      # a client that went away frees its slot at the next step
                    release()
            return StreamingResponse(events(), media_type="text/event-stream")

        out = []
        try:
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    out.append(value)
                    continue
                break
        finally:
            work.cancelled = True
            release()
        if value.startswith("error"):
            return _error(500, value.removeprefix("error: "), "server_error")
        out.append(text.rest())
        body = chunk("".join(out), "stop" if value in ("stop", "cancelled") else value)
        body["usage"] = {"prompt_tokens": len(ids), "completion_tokens": work.generated,
                         "total_tokens": len(ids) + work.generated}
        return JSONResponse(body)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        worker.start()
        try:
            yield
        finally:                       # requests still running are told the server is going away
            batcher.stop()
            worker.join(timeout=10)

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])],
                     lifespan=lifespan)
