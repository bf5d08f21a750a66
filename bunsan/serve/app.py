"""`bunsan serve`'s HTTP side on Starlette: the Service (the batcher's thread, admission, health, a bounded
shutdown) and the app's routes: OpenAI's (openai_routes.py), Ollama's (ollama_routes.py), embeddings
(embeddings.py), GET /health and GET /metrics (metrics.py).

The batcher runs on a thread of its own; each request's sequences report to an asyncio queue (jobs.py), so a
slow reader only lets its own queue grow and a dropped connection cancels its sequences. Every error is
OpenAI's JSON shape (errors.py), routing errors and the server's own failures included.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bunsan.serve.batcher import Batcher
from bunsan.serve.body import BodyLimits
from bunsan.serve.chat import ChatTemplate
from bunsan.serve.embeddings import EmbeddingRoutes
from bunsan.serve.errors import ApiError, http_error, server_error
from bunsan.serve.jobs import Job
from bunsan.serve.lora import LoraRoutes
from bunsan.serve.metrics import ServeMetrics
from bunsan.serve.ollama_routes import OllamaRoutes
from bunsan.serve.openai_routes import SHUTDOWN, OpenAIRoutes
from bunsan.serve.requests import Generation, Limits


class Service:
    """One batcher, the thread it runs on, and what every endpoint needs to know about the model."""

    def __init__(self, batcher: Batcher, tokenizer, model_name: str, limits: Limits,
                 aliases: tuple[str, ...] = (), template: ChatTemplate | None = None, root: str | None = None,
                 runtime_lora: bool = False, vision=None):
        """`vision`: a vision-language model's media.VisionInputs (its processor, the image reader), else None."""
        self.batcher, self.tokenizer, self.limits, self.vision = batcher, tokenizer, limits, vision
        self.served = [model_name] + [a for a in aliases if a != model_name]
        self.model_name, self.root = self.served[0], root or model_name
        self.vocab, self.context = batcher.model.config.vocab_size, batcher.max_len
        self.eos = frozenset({tokenizer.eos_token_id} - {None})
        self.template = template or ChatTemplate(tokenizer)
        self.body_limits = BodyLimits(limits.max_body_bytes, limits.body_timeout_s)
        self.worker = threading.Thread(target=batcher.run, name="bunsan-batcher", daemon=True)
        self.open_sequences = 0    # accepted and not yet fully answered (the event loop's own count: no lock)
        self.closing = False
        self.created = int(time.time())
        self.grammar_tokenizer = None       # structured outputs' view of the tokenizer (structured.py)
        self.metrics = ServeMetrics(batcher, self.model_name)
        self.adapters, self.runtime_lora = batcher.adapters, runtime_lora    # LoRA adapters (lora.py)
        self.adapter_open: dict[str, int] = {}       # open sequences per adapter (not unloaded while any)
        if self.adapters is not None:
            self.served += [name for name in self.adapters.slots if name not in self.served]

    @property
    def read_image(self):
        """The image reader of a vision model's requests (media.ImageReader.url); None: images are refused."""
        return self.vision.reader.url if self.vision is not None else None

    def render(self, messages: list[dict], images: list) -> tuple[list[int], object]:
        """The prompt of chat `messages`: (its token ids, its images as media.Media, or None without any)."""
        if not images:
            return self.template.render(messages), None
        if self.batcher.leader is not None:
            raise ApiError(400, "images are not served under tensor parallelism (--tp); serve the model in one "
                                "process for them", param="messages")
        return self.vision.layout(self.template.text(messages, self.vision.placeholder), images)

    def alive(self) -> bool:
        return self.worker.is_alive() and not self.batcher.stopped

    def start(self, gen: Generation, prefix: str, model: str | None = None) -> Job:
        """Admit a valid request and hand its sequences to the batcher; refuse one the server cannot take now:
        too many open (429), shutting down or no worker (503)."""
        if self.closing or not self.alive():
            raise ApiError(503, f"{SHUTDOWN}; retry on another server" if self.closing else
                           "the model worker has stopped; the server is shutting down")
        if self.open_sequences + gen.sequences > self.limits.max_concurrent:
            raise ApiError(429, f"{self.open_sequences} of {self.limits.max_concurrent} sequences are already "
                                "running or waiting; retry later", code="rate_limit_exceeded")
        constraint = None
        if gen.grammar is not None:
            from bunsan.serve.structured import Constraint, grammar_tokenizer
            if self.grammar_tokenizer is None:        # indexes the vocabulary once, at the first such request
                ends = set(getattr(self.tokenizer, "stop_ids", None) or []) | self.eos
                self.grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab, sorted(ends))
            constraint = lambda: Constraint(self.grammar_tokenizer, gen.grammar)   # noqa: E731
        adapter = model if self.adapters is not None and model in self.adapters.slots else None
        job = Job(gen, self.tokenizer, self.vocab, self.eos | gen.stop_ids, prefix, self._release, constraint,
                  self.metrics, (self.adapters.slots[adapter], self.adapters.roots[adapter]) if adapter else (0, 0))
        job.adapter = adapter
        if adapter is not None:
            self.adapter_open[adapter] = self.adapter_open.get(adapter, 0) + gen.sequences
        self.open_sequences += gen.sequences
        try:
            job.submit(self.batcher)
        except ValueError as e:           # the batcher refuses what its KV pool could never hold
            job.close()                    # its sequences already queued are cancelled, the count given back
            raise ApiError(400, str(e), param="max_tokens") from None
        except ApiError:                   # the model's process is gone (engine_client.py): a 503
            job.close()
            raise
        self.metrics.accepted(job)
        return job

    def _release(self, job: Job) -> None:
        self.open_sequences -= job.gen.sequences
        if job.adapter is not None:
            self.adapter_open[job.adapter] -= job.gen.sequences

    async def health(self, _: HTTPRequest) -> JSONResponse:
        active, waiting = self.batcher.load()
        alive = self.alive() and not self.closing
        b = self.batcher
        pool = b.pool
        return JSONResponse({"status": "ok" if alive else "stopped", "model": self.model_name, "active": active,
                             "waiting": waiting, "slots": b.slots, "context": self.context,
                             "kv_block_size": pool.block_size, "kv_blocks": pool.usable,
                             "kv_blocks_free": pool.available(), "kv_tokens": pool.usable * pool.block_size,
                             "decode_steps": b.steps, "preempted": b.preempted,
                             "prefix_tokens_reused": b.reused_tokens}, status_code=200 if alive else 503)

    async def prometheus(self, _: HTTPRequest) -> Response:
        body, content_type = self.metrics.text()
        return Response(body, media_type=content_type)

    async def drain(self, grace_s: float) -> None:
        """Shut down within `grace_s`: new requests get 503 at once; running ones may finish for `grace_s`
        seconds, then every one still running is answered with an error (a 503, or a stream's error event)."""
        self.closing = True
        deadline = time.monotonic() + grace_s
        while self.open_sequences > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.batcher.stop()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        self.worker.start()
        try:
            yield
        finally:                       # requests still running are told the server is going away
            self.closing = True
            self.batcher.stop()
            self.worker.join(timeout=10)


def build_app(batcher: Batcher, tokenizer, model_name: str, limits: Limits | None = None, *,
              aliases: tuple[str, ...] = (), template: ChatTemplate | None = None,
              runtime_lora: bool = False, vision=None) -> Starlette:
    """The app; `app.state.service` is its Service (bunsan serve's shutdown drains it)."""
    service = Service(batcher, tokenizer, model_name, limits or Limits(), aliases, template,
                      runtime_lora=runtime_lora, vision=vision)
    routes = [Route("/health", service.health), Route("/metrics", service.prometheus),
              *OpenAIRoutes(service).routes(), *OllamaRoutes(service).routes(), *EmbeddingRoutes(service).routes(),
              *LoraRoutes(service).routes()]
    app = Starlette(routes=routes, lifespan=service.lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.service = service
    return app
