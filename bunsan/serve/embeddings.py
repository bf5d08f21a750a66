"""Embeddings from the served model: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed (and its older
/api/embeddings). An input's embedding is the model's final hidden state (the head's input) at its last
token, L2-normalised: what vLLM's default pooler gives a decoder-only model, and what an embedding model
fine-tuned from it (last-token pooling, as E5-Mistral and Qwen3-Embedding) expects. The forward runs on the
batcher's thread between two steps (batcher.hidden)."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bunsan.serve.body import ClientGone, read_json
from bunsan.serve.errors import ApiError, shown
from bunsan.serve.paged import input_device
from bunsan.serve.requests import Strict, check_model, check_text, prompt_ids, validated

MAX_INPUTS = 256          # per request: each is a forward on the batcher's thread


class HiddenQueue:
    """Hidden-state requests waiting for the batcher's thread: `put` from any thread, `run` between two steps
    (the model is never run from two threads), `fail` what is left when serving ends."""

    def __init__(self):
        self.lock, self.waiting = threading.Lock(), deque()

    def put(self, ids: list[int]) -> Future:
        done = Future()
        with self.lock:
            self.waiting.append((ids, done))
        return done

    def _next(self):
        with self.lock:
            return self.waiting.popleft() if self.waiting else None

    def run(self, model) -> None:
        while (item := self._next()) is not None:
            ids, done = item
            try:
                done.set_result(final_hidden(model, ids))
            except Exception as e:        # this input's failure is its own
                done.set_exception(e)

    def fail(self, error: Exception) -> None:
        while (item := self._next()) is not None:
            item[1].set_exception(error)


def final_hidden(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), hidden] fp32 on the CPU: what the model's head reads at every position (after the final
    norm), for bunsan's Llama or a transformers model behind serve's forward (transformers_model.py)."""
    hf = getattr(model, "hf_model", None)
    head = model.lm_head if hf is None else hf.get_output_embeddings()
    seen = []
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    tokens = torch.tensor([ids], device=input_device(model))
    try:
        with torch.no_grad():
            model(tokens) if hf is None else hf(input_ids=tokens, use_cache=False)
    finally:
        handle.remove()
    return seen[0][0].float().cpu()


def pooled(hidden: torch.Tensor) -> torch.Tensor:
    """The last token's state, L2-normalised."""
    return torch.nn.functional.normalize(hidden[-1], dim=0)


class EmbeddingsBody(Strict):
    model: str | None = None
    input: str | list = None
    encoding_format: str | None = "float"
    dimensions: int | None = None
    user: str | None = None


class OllamaEmbedBody(Strict):
    model: str
    input: str | list[str] | None = None
    prompt: str | None = None                   # /api/embeddings' field
    truncate: bool | None = True
    dimensions: int | None = None
    options: dict | None = None
    keep_alive: str | int | float | None = None


class EmbeddingRoutes:
    def __init__(self, service):
        self.service = service

    async def _vectors(self, inputs: list[list[int]], dimensions: int | None) -> list[torch.Tensor]:
        s = self.service
        size = s.batcher.model.config.hidden_size
        if len(inputs) > MAX_INPUTS:
            raise ApiError(400, f"{len(inputs)} inputs in one request; send at most {MAX_INPUTS}", param="input")
        if dimensions is not None and dimensions != size:
            raise ApiError(400, f"dimensions {dimensions}: this model's embeddings have {size} (it is not trained "
                                "to be cut shorter); leave dimensions out", param="dimensions")
        try:
            futures = [s.batcher.hidden(ids) for ids in inputs]
        except ValueError as e:
            raise ApiError(400, str(e), param="input") from None
        return [pooled(await asyncio.wrap_future(f)) for f in futures]

    async def openai(self, http: HTTPRequest) -> Response:
        s = self.service
        try:
            body = validated(EmbeddingsBody, await read_json(http, s.body_limits))
            check_model(body.model, s.served)
            if body.encoding_format not in ("float", "base64"):
                raise ApiError(400, f"encoding_format {shown(body.encoding_format)} is not float or base64",
                               param="encoding_format")
            if body.input is None:
                raise ApiError(400, "input is missing; send text, a list of texts or token ids", param="input")
            inputs = prompt_ids(body.input, s.tokenizer, s.vocab)
            vectors = await self._vectors(inputs, body.dimensions)
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.response()

        def encoded(v: torch.Tensor):
            return v.tolist() if body.encoding_format == "float" else \
                base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        tokens = sum(len(ids) for ids in inputs)
        return JSONResponse({"object": "list", "model": s.model_name, "usage": {"prompt_tokens": tokens,
                                                                              "total_tokens": tokens},
                             "data": [{"object": "embedding", "index": i, "embedding": encoded(v)}
                                      for i, v in enumerate(vectors)]})

    async def ollama(self, http: HTTPRequest) -> Response:
        s = self.service
        legacy = http.url.path.endswith("/embeddings")
        started = time.time()
        try:
            body = validated(OllamaEmbedBody, await read_json(http, s.body_limits))
            if body.model not in s.served:
                raise ApiError(404, f"model {shown(body.model)} not found; this server has {', '.join(s.served)}",
                               param="model")
            texts = [body.prompt] if legacy else ([body.input] if isinstance(body.input, str) else body.input)
            if not texts or any(not isinstance(t, str) or not t for t in texts):
                raise ApiError(400, f"{'prompt' if legacy else 'input'} must be non-empty text (or texts)",
                               param="prompt" if legacy else "input")
            inputs = [s.tokenizer.encode(check_text(t, "input")) for t in texts]
            if body.truncate is not False:
                inputs = [ids[:s.context] for ids in inputs]
            vectors = await self._vectors(inputs, body.dimensions)
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.ollama_response()
        if legacy:
            return JSONResponse({"embedding": vectors[0].tolist()})
        return JSONResponse({"model": body.model, "embeddings": [v.tolist() for v in vectors],
                             "total_duration": int((time.time() - started) * 1e9), "load_duration": 0,
                             "prompt_eval_count": sum(len(ids) for ids in inputs)})

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.openai, methods=["POST"]),
                Route("/api/embed", self.ollama, methods=["POST"]),
                Route("/api/embeddings", self.ollama, methods=["POST"])]
