"""OpenAI's API: POST /v1/completions and /v1/chat/completions (whole answers, or server-sent events ending
in `data: [DONE]`), GET /v1/models and /v1/models/{id}. Errors in OpenAI's shape (errors.py)."""

from __future__ import annotations

import asyncio
import json

from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bunsan.serve.body import ClientGone, read_json
from bunsan.serve.errors import ApiError, shown
from bunsan.serve.jobs import Job
from bunsan.serve.media import parsed
from bunsan.serve.openai_format import ChatFormat, CompletionFormat
from bunsan.serve.requests import chat_request, completion_request

SHUTDOWN = "the server is shutting down"


def failure(message: str) -> ApiError:
    """A sequence's failure as the answer: 503 while the server shuts down (retry elsewhere), else 500."""
    return ApiError(503 if SHUTDOWN in message else 500, message)


def sse(value: dict) -> str:
    return f"data: {json.dumps(value)}\n\n"


async def stream_events(job: Job, fmt: CompletionFormat):
    """A chunk per choice's first event (its echoed prompt, or chat's role), a chunk per text delta, a last
    chunk per choice with its finish reason, the usage when asked, then [DONE]; an error event on failure."""
    opened = set()
    try:
        async for choice, kind, text in job.events():
            if choice.index not in opened:
                opened.add(choice.index)
                first = fmt.prompt_part(choice, choice.index)
                if first is not None:
                    yield sse(fmt.chunk([first]))
            if kind == "delta":
                yield sse(fmt.chunk([fmt.delta(choice, choice.index, text)]))
            elif kind == "end" and not choice.end.startswith("error"):
                yield sse(fmt.chunk([fmt.delta(choice, choice.index, text, choice.reason)]))
        error = job.error()
        if error is not None:
            yield sse(failure(error).body())
        elif job.gen.include_usage:
            yield sse(fmt.chunk([], job.usage()))
        yield "data: [DONE]\n\n"
    finally:
        job.close()


async def whole_answer(job: Job, fmt: CompletionFormat, http: HTTPRequest) -> Response:
    """The whole answer in one body; a client that disconnects first cancels its sequences at once."""
    watcher = asyncio.create_task(job.watch(http))
    try:
        async for _, kind, _ in job.events():
            if kind == "gone":
                return Response(status_code=499)      # nobody reads it; nginx's "client closed request"
    finally:
        watcher.cancel()
        job.close()
    error = job.error()
    if error is not None:
        return failure(error).response()
    return JSONResponse(fmt.whole(job.best()))


class OpenAIRoutes:
    """The endpoints over a Service (app.py): its batcher, tokenizer, chat template and limits."""

    def __init__(self, service):
        self.service = service

    async def _answer(self, http: HTTPRequest, parse, fmt_type) -> Response:
        s = self.service
        try:
            body = await read_json(http, s.body_limits)
            asked = body.get("model")                 # answered under the name asked for (one served)
            gen = await parsed(parse, body, s)
            job = s.start(gen, fmt_type.prefix, asked if isinstance(asked, str) else None)
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.response()
        fmt = fmt_type(job, s.tokenizer, asked if isinstance(asked, str) else s.model_name)
        if gen.stream:
            return StreamingResponse(stream_events(job, fmt), media_type="text/event-stream",
                                     background=BackgroundTask(job.close))   # even if never iterated
        return await whole_answer(job, fmt, http)

    async def completions(self, http: HTTPRequest) -> Response:
        s = self.service
        return await self._answer(http, lambda body: completion_request(
            body, s.limits, s.tokenizer, s.vocab, s.context, s.served), CompletionFormat)

    async def chat(self, http: HTTPRequest) -> Response:
        s = self.service

        def parse(body: dict):
            gen = chat_request(body, s.limits, s.render, s.vocab, s.context, s.served, s.read_image)
            gen.stop += [x for x in s.template.stop if x not in gen.stop]
            gen.stop_ids = frozenset(s.template.eos_ids)
            return gen
        return await self._answer(http, parse, ChatFormat)

    def model_card(self) -> dict:
        s = self.service
        return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "bunsan",
                "root": s.root, "parent": None, "max_model_len": s.context}

    def card_of(self, name: str) -> dict:
        """A served name's card; a LoRA adapter's has the base model as its parent and its folder as root."""
        adapters = self.service.adapters
        if adapters is not None and name in adapters.slots:
            return self.model_card() | {"id": name, "parent": self.service.model_name, "root": adapters.paths[name]}
        return self.model_card() | {"id": name}

    async def models(self, _: HTTPRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self.card_of(name) for name in self.service.served]})

    async def model(self, http: HTTPRequest) -> JSONResponse:
        name = http.path_params["name"]
        if name not in self.service.served:
            return ApiError(404, f"the model {shown(name)} does not exist here; GET /v1/models lists the served "
                                 "ones", param="model", code="model_not_found").response()
        return JSONResponse(self.card_of(name))

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{name:path}", self.model, methods=["GET"])]
