"""Ollama's native API where it is cheap: POST /api/generate and /api/chat (streamed as NDJSON by default,
as Ollama does; `"stream": false` for one object), GET /api/tags and /api/version. Errors are Ollama's
{"error": message}, the shape its clients read.

Options follow Ollama's names (num_predict, repeat_penalty, ...) and its sampling defaults (temperature 0.8,
top_k 40, top_p 0.9); the options about Ollama's own runtime (num_ctx, num_gpu, ...) are accepted and ignored
(logged once each), those for features not built here are a 400 unless set to what asks for nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timezone

from pydantic import Field
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bunsan.serve.body import ClientGone, read_json
from bunsan.serve.errors import ApiError, shown
from bunsan.serve.jobs import Job
from bunsan.serve.media import parsed
from bunsan.serve.requests import (INT64, Generation, SamplingFields, Strict, chat_messages, check_text,
                                   fit_context, sampling_params, stop_strings, validated)

log = logging.getLogger("bunsan.serve")
RUNTIME_OPTIONS = {"num_ctx", "num_thread", "num_gpu", "num_batch", "main_gpu", "use_mmap", "use_mlock", "numa",
                   "low_vram", "num_keep", "vocab_only"}
NEUTRAL_OPTIONS = {"mirostat": (None, 0), "mirostat_eta": (None,), "mirostat_tau": (None,), "tfs_z": (None, 1.0),
                   "typical_p": (None, 1.0), "repeat_last_n": (None, -1), "penalize_newline": (None, False)}
_warned: set[str] = set()


class Options(Strict):
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    num_predict: int | None = Field(None, ge=-2)
    stop: list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)


class ShowBody(Strict):
    model: str | None = None
    name: str | None = None               # the older field
    verbose: bool | None = None


class OllamaBody(Strict):
    model: str
    stream: bool | None = True
    options: dict | None = None
    keep_alive: str | int | float | None = None        # how long Ollama keeps a model loaded: always, here
    format: str | dict | None = None
    think: bool | None = None


class GenerateBody(OllamaBody):
    prompt: str = ""
    system: str | None = None
    raw: bool | None = False
    context: list[int] | None = None
    suffix: str | None = None
    images: list | None = None


class OllamaMessage(Strict):
    role: str
    content: str = ""
    images: list | None = None


class ChatBody(OllamaBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list | None = None


def options(raw: dict | None) -> Options:
    raw = dict(raw or {})
    for name in list(raw):
        if name in RUNTIME_OPTIONS:
            if name not in _warned:
                _warned.add(name)
                log.warning("ignoring Ollama option %r: it tunes Ollama's runtime, not the answer", name)
            raw.pop(name)
        elif name in NEUTRAL_OPTIONS:
            if raw[name] not in NEUTRAL_OPTIONS[name]:
                raise ApiError(400, f"option {name} is not supported by this server (got {shown(raw[name])}); "
                                    "remove it", param=f"options.{name}")
            raw.pop(name)
    opts = validated(Options, raw)
    if opts.num_predict == 0:
        raise ApiError(400, "options.num_predict 0 generates nothing; use -1 for as many as allowed",
                       param="options.num_predict")
    return opts


def refuse_features(body: OllamaBody) -> None:
    if body.think:
        raise ApiError(400, "think is not supported (the model has no separate reasoning); remove it", param="think")


def with_images(message: dict, images: list | None, where: str, service, read: list) -> dict:
    """An Ollama message's `images` (base64 strings) as image parts before its text, each read into `read`."""
    if not images:
        return message
    if service.vision is None:
        raise ApiError(400, f"{where} holds images; this server's model takes text only: remove them", param=where)
    read += [service.vision.reader.base64(image, f"{where}[{j}]") for j, image in enumerate(images)]
    text = [{"type": "text", "text": message["content"]}] if message["content"] else []
    return message | {"content": [{"type": "image"} for _ in images] + text}


def ollama_grammar(format_) -> str | None:
    """Ollama's `format`: "json" (any JSON value) or a JSON schema, as structured outputs (structured.py)."""
    from bunsan.serve.structured import grammar_request
    if format_ in (None, ""):
        return None
    if format_ == "json":
        return grammar_request(None, {"json": {}}, {})
    if isinstance(format_, dict):
        return grammar_request(None, {"json": format_}, {})
    raise ApiError(400, f"format {shown(format_)} is neither \"json\" nor a JSON schema", param="format")


def generation(body: OllamaBody, prompt: list[int], opts: Options, service, media=None) -> Generation:
    fields = SamplingFields(temperature=0.8 if opts.temperature is None else opts.temperature,
                            top_k=40 if opts.top_k is None else opts.top_k, top_p=opts.top_p or 0.9,
                            min_p=opts.min_p, presence_penalty=opts.presence_penalty,
                            frequency_penalty=opts.frequency_penalty, repetition_penalty=opts.repeat_penalty,
                            seed=opts.seed)
    gen = Generation(prompts=[prompt], max_tokens=[], sampling=sampling_params(fields, service.vocab, None),
                     stop=stop_strings(opts.stop, service.limits), stream=body.stream is not False,
                     grammar=ollama_grammar(body.format), media=[media])
    asked = opts.num_predict if opts.num_predict and opts.num_predict > 0 else None
    fit_context(gen, asked, service.limits, service.context, "options.num_predict")
    return gen


class OllamaRoutes:
    def __init__(self, service):
        self.service = service

    def check_model(self, name: str) -> None:
        if name not in self.service.served and name.removesuffix(":latest") not in self.service.served:
            raise ApiError(404, f"model {shown(name)} not found; this server serves "
                                f"{', '.join(self.service.served)} (GET /api/tags)", param="model")

    def _generate_prompt(self, body: GenerateBody) -> tuple[list[int], object]:
        """(the prompt's ids, its images as media.Media or None)."""
        s = self.service
        if body.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported; remove it", param="suffix")
        text = check_text(body.prompt, "prompt")
        if body.images and (body.raw or body.context):
            raise ApiError(400, "images with raw or context: the image tokens are laid out by the chat template; "
                                "send them without raw and context", param="images")
        if body.images or not body.raw and s.template.source != "the default ChatML template":
            images: list = []                         # the model's own chat format
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                [with_images({"role": "user", "content": text}, body.images, "images", s, images)]
            ids, media = s.render(messages, images)
            return list(body.context or []) + ids, media
        text = f"{check_text(body.system, 'system')}\n\n{text}" if body.system else text
        return list(body.context or []) + s.tokenizer.encode(text), None

    async def generate(self, http: HTTPRequest) -> Response:
        def parse(raw: dict):
            body = validated(GenerateBody, raw)
            self.check_model(body.model)
            refuse_features(body)
            if not body.prompt and not body.system and not body.images:   # Ollama's "load the model"
                return None, body
            if any(not 0 <= t < self.service.vocab for t in body.context or []):
                raise ApiError(400, f"context holds a token id outside 0..{self.service.vocab - 1}", param="context")
            ids, media = self._generate_prompt(body)
            return generation(body, ids, options(body.options), self.service, media), body
        return await self._answer(http, parse, "response")

    async def chat(self, http: HTTPRequest) -> Response:
        def parse(raw: dict):
            body = validated(ChatBody, raw)
            self.check_model(body.model)
            refuse_features(body)
            if body.tools:
                raise ApiError(400, "tools are not supported; remove them", param="tools")
            if not body.messages:
                return None, body
            images: list = []
            messages = [with_images(m, body.messages[i].images, f"messages[{i}].images", self.service, images)
                        for i, m in enumerate(chat_messages(body.messages))]
            ids, media = self.service.render(messages, images)
            gen = generation(body, ids, options(body.options), self.service, media)
            gen.stop += [x for x in self.service.template.stop if x not in gen.stop]
            gen.stop_ids = frozenset(self.service.template.eos_ids)
            return gen, body
        return await self._answer(http, parse, "message")

    async def _answer(self, http: HTTPRequest, parse, field: str) -> Response:
        try:
            gen, body = await parsed(parse, await read_json(http, self.service.body_limits), self.service)
            if gen is None:
                return JSONResponse(self.line(body.model, field, "") | {"done": True, "done_reason": "load"})
            job = self.service.start(gen, "ollama", body.model.removesuffix(":latest"))
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.ollama_response()
        if gen.stream:
            return StreamingResponse(self.lines(job, body.model, field), media_type="application/x-ndjson",
                                     background=BackgroundTask(job.close))
        text, watcher = [], asyncio.create_task(job.watch(http))      # a client that leaves cancels it
        try:
            async for _, kind, value in job.events():
                if kind == "gone":
                    return Response(status_code=499)
                text.append(value or "")
        finally:
            watcher.cancel()
            job.close()
        if job.error():
            return ApiError(503 if "shutting down" in job.error() else 500, job.error()).ollama_response()
        return JSONResponse(self.line(body.model, field, "".join(text)) | self.summary(job, field))

    def line(self, model: str, field: str, text: str) -> dict:
        at = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        content = text if field == "response" else {"role": "assistant", "content": text}
        return {"model": model, "created_at": at, field: content, "done": False}

    def summary(self, job: Job, field: str) -> dict:
        """The last object's fields: why it ended, the token counts, the durations in nanoseconds (and for
        /api/generate the context: the tokens to send back as `context` to continue)."""
        c, total = job.choices[0], int((time.time() - job.started) * 1e9)
        out = {"done": True, "done_reason": c.reason, "total_duration": total, "load_duration": 0,
               "prompt_eval_count": len(c.ids), "prompt_eval_duration": 0, "eval_count": c.completion_tokens,
               "eval_duration": total}
        if field == "response":
            out["context"] = c.ids + [t.id for t in c.tokens]
        return out

    async def lines(self, job: Job, model: str, field: str):
        try:
            async for _, kind, value in job.events():
                if value:
                    yield json.dumps(self.line(model, field, value)) + "\n"
            if job.error():
                yield json.dumps({"error": job.error()}) + "\n"
            else:
                yield json.dumps(self.line(model, field, "") | self.summary(job, field)) + "\n"
        finally:
            job.close()

    def _model(self) -> tuple[dict, int, int]:
        """(Ollama's details of the served model, its parameters, its weights' bytes)."""
        model = self.service.batcher.model
        params = sum(p.numel() for p in model.parameters())
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        family = getattr(model.config, "model_type", "llama")
        details = {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
                   "parameter_size": f"{params / 1e6:.1f}M",
                   "quantization_level": str(next(model.parameters()).dtype).removeprefix("torch.")}
        return details, params, size

    async def tags(self, _: HTTPRequest) -> JSONResponse:
        s = self.service
        at = datetime.fromtimestamp(s.created, timezone.utc).isoformat().replace("+00:00", "Z")
        details, _, size = self._model()
        models = [{"name": name, "model": name, "modified_at": at, "size": size, "digest": "", "details": details}
                  for name in s.served]
        return JSONResponse({"models": models})

    async def ps(self, _: HTTPRequest) -> JSONResponse:
        """The model in memory: its weights and the KV cache, all of it where the server put it."""
        s = self.service
        details, _, size = self._model()
        size += s.batcher.cache.nbytes
        on_gpu = s.batcher.cache.device.type == "cuda"
        models = [{"name": name, "model": name, "size": size, "digest": "", "details": details,
                   "expires_at": "9999-12-31T23:59:59Z", "size_vram": size if on_gpu else 0,
                   "context_length": s.context} for name in s.served]
        return JSONResponse({"models": models})

    async def show(self, http: HTTPRequest) -> Response:
        s = self.service
        try:
            body = validated(ShowBody, await read_json(http, s.body_limits))
            name = body.model or body.name
            if name is None:
                raise ApiError(400, "model is missing; name the model to show", param="model")
            self.check_model(name)
        except ClientGone:
            return Response(status_code=499)
        except ApiError as e:
            return e.ollama_response()
        details, params, _ = self._model()
        cfg = s.batcher.model.config
        family = details["family"]
        info = {"general.architecture": family, "general.parameter_count": params,
                f"{family}.context_length": s.context, f"{family}.block_count": cfg.num_hidden_layers,
                f"{family}.attention.head_count": cfg.num_attention_heads,
                f"{family}.attention.head_count_kv": cfg.num_key_value_heads,
                f"{family}.embedding_length": cfg.hidden_size, f"{family}.vocab_size": cfg.vocab_size}
        at = datetime.fromtimestamp(s.created, timezone.utc).isoformat().replace("+00:00", "Z")
        template = s.template.template if s.template.hf is None else s.template.hf.chat_template
        return JSONResponse({"modelfile": "", "parameters": "", "template": template or "",
                             "details": details, "model_info": info, "modified_at": at,
                             "capabilities": ["completion", "embedding"] + ["vision"] * (s.vision is not None)})

    async def version(self, _: HTTPRequest) -> JSONResponse:
        return JSONResponse({"version": "0.0.0-bunsan"})

    def routes(self) -> list[Route]:
        return [Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/version", self.version, methods=["GET"])]
