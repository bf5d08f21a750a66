"""What a request may be: the server's limits, the fields of a completion and of a chat completion (strict
types: no "10" for an integer, no "yes" for a boolean), and what they mean for the batcher (`Generation`).

Every field a client sends is used, refused (a 400 naming it), or on the short list of fields accepted and
ignored (IGNORED, each with why; logged once per field). Unknown fields are refused, never dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bunsan.serve.errors import ApiError, explain, shown
from bunsan.serve.sampling import SamplingParams

log = logging.getLogger("bunsan.serve")

INT64 = 1 << 63
GREEDY_BELOW = 1e-5       # a temperature below this is greedy, as in vLLM (1e-45 would divide the logits to inf)

# accepted and ignored: what each would do at OpenAI, and why it changes nothing here
IGNORED = {
    "user": "an end-user id for abuse monitoring; this server keeps no such records",
    "metadata": "tags for stored completions; nothing is stored",
    "store": "whether OpenAI stores the completion; nothing is stored",
    "service_tier": "OpenAI's processing tier; there is one tier",
    "safety_identifier": "an end-user id for abuse monitoring; this server keeps no such records",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; the prefix cache here needs none",
    "parallel_tool_calls": "only meaningful with tools, which are refused",
}
# refused unless neutral (these values ask for nothing): the feature is not built
UNSUPPORTED = {
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "reasoning_effort": (None,),
}
_warned: set[str] = set()


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 1024             # the most one request may ask for
    max_concurrent: int = 1024         # sequences running or waiting; beyond, 429
    body_timeout_s: float = 30.0       # the whole body must arrive within this (408)
    max_stop: int = 16                 # stop strings per request
    max_stop_chars: int = 256          # characters per stop string
    max_n: int = 16                    # n and best_of
    max_logprobs: int = 20             # logprobs / top_logprobs


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool | None = False


class SamplingFields(Strict):
    """The fields completions and chat completions share (None: the default)."""
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)            # 0 and -1: off, as in vLLM
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    # structured outputs (structured.py): OpenAI's response_format, vLLM's structured_outputs and older names
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


@dataclass
class Generation:
    """What one request asks of the batcher, whatever its API: `n` sequences per prompt (the best `n` of
    `best_of`), each up to `max_tokens` new tokens."""
    prompts: list[list[int]]
    max_tokens: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    n: int = 1
    best_of: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None            # reported: None, or the top-k alternatives per token
    prompt_logprobs: int | None = None     # echo with logprobs: the prompt's too
    stop_ids: frozenset[int] = frozenset()  # tokens that end a sequence besides the tokenizer's end of text
    grammar: str | None = None             # llguidance's grammar every sequence's tokens follow (structured.py)
    media: list = field(default_factory=list)   # each prompt's images (media.Media), or none: text only

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.best_of


def screen(body: dict, known: set[str]) -> dict:
    """The body without the IGNORED fields (logged once each); 400 for an UNSUPPORTED field set to something."""
    for name in list(body):
        if name in IGNORED and name not in known:
            if name not in _warned:
                _warned.add(name)
                log.warning("ignoring %r in requests: %s", name, IGNORED[name])
            body.pop(name)
        elif name in UNSUPPORTED and name not in known:
            if body[name] not in UNSUPPORTED[name]:
                raise ApiError(400, f"{name} is not supported by this server (got {shown(body[name])}); remove it",
                               param=name)
            body.pop(name)
    return body


def validated(model: type[BaseModel], body: dict) -> BaseModel:
    try:
        return model.model_validate(screen(body, set(model.model_fields)))
    except ValidationError as e:
        raise explain(e) from e


def check_text(text: str, where: str) -> str:
    """A string the tokenizer can encode: JSON lets a lone UTF-16 surrogate (\\ud800) through."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{where} holds an unpaired surrogate {shown(text[e.start])} at {e.start}; send valid "
                            "Unicode", param=where) from e
    return text


def stop_strings(stop, limits: Limits) -> list[str]:
    """`stop` as a list within the limits; an empty string matches nothing."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"stop has {len(stop)} strings; at most {limits.max_stop} are allowed", param="stop")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_chars:
            raise ApiError(400, f"stop[{i}] has {len(s)} characters; at most {limits.max_stop_chars} are allowed",
                           param="stop")
        check_text(s, f"stop[{i}]")
    return [s for s in stop if s]


def logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise ApiError(400, f"logit_bias key {shown(key)} is not a token id in 0..{vocab - 1}",
                           param="logit_bias")
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key}] = {value} is outside -100..100", param="logit_bias")
        out[int(key)] = value
    return out


def requested_grammar(req: SamplingFields) -> str | None:
    from bunsan.serve.structured import LEGACY, grammar_request
    return grammar_request(req.response_format, req.structured_outputs, {k: getattr(req, k) for k in LEGACY})


def sampling_params(req: SamplingFields, vocab: int, logprobs: int | None) -> SamplingParams:
    """The fields as the sampler reads them: None is the default, a tiny temperature is greedy, top_k 0/-1 off."""
    temperature = 1.0 if req.temperature is None else req.temperature
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_k=req.top_k if req.top_k and req.top_k > 0 else None,
        top_p=1.0 if req.top_p is None else req.top_p, min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=logit_bias(req.logit_bias, vocab), seed=req.seed, logprobs=logprobs)


def check_model(name: str | None, served: list[str]) -> None:
    """`model` must name the served model (or an alias of it); absent means the served one."""
    if name is not None and name not in served:
        raise ApiError(404, f"the model {shown(name)} does not exist here; this server serves "
                            f"{', '.join(map(repr, served))} (GET /v1/models)", param="model", code="model_not_found")


def check_counts(n: int | None, best_of: int | None, logprobs: int | None, limits: Limits) -> tuple[int, int]:
    """(n, best_of) within the limits; logprobs too."""
    n = n or 1
    best_of = best_of or n
    if n > limits.max_n or best_of > limits.max_n:
        raise ApiError(400, f"n {n} / best_of {best_of}: at most {limits.max_n} sequences per prompt", param="n")
    if best_of < n:
        raise ApiError(400, f"best_of {best_of} must be at least n {n}", param="best_of")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise ApiError(400, f"logprobs {logprobs} exceeds the limit of {limits.max_logprobs}", param="logprobs")
    return n, best_of


def fit_context(gen: Generation, asked: int | None, limits: Limits, context: int, param: str) -> None:
    """Each prompt's max_tokens: as asked (within the server's limit and the context), or, unasked, as many as
    the context leaves (within the limit)."""
    if asked is not None and asked > limits.max_tokens:
        raise ApiError(400, f"{param} {asked} exceeds this server's limit of {limits.max_tokens}; ask for fewer",
                       param=param)
    for ids in gen.prompts:
        room = context - len(ids)
        want = min(limits.max_tokens, room) if asked is None else asked
        if room < 1 or want > room:
            raise ApiError(400, f"prompt of {len(ids)} tokens + {param} {want} exceeds the context of {context} "
                                "tokens; shorten the prompt or ask for fewer tokens", param=param)
        gen.max_tokens.append(want)
    if gen.sequences > limits.max_concurrent:
        raise ApiError(400, f"{len(gen.prompts)} prompts x {gen.best_of} sequences = {gen.sequences} exceeds "
                            f"--max-concurrent {limits.max_concurrent}; send fewer at once", param="prompt")


class CompletionBody(SamplingFields):
    prompt: str | list
    max_tokens: int | None = Field(16, ge=0)          # 0 only with echo: score the prompt, generate nothing
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1)


def prompt_ids(prompt, tokenizer, vocab: int) -> list[list[int]]:
    """`prompt` as token ids: a string, a list of strings, a list of token ids, or a list of such lists."""
    def tokens(ids: list, where: str) -> list[int]:
        if not ids:
            raise ApiError(400, f"{where} is empty; send some token ids", param="prompt")
        bad = next((x for x in ids if type(x) is not int or not 0 <= x < vocab), None)
        if bad is not None:
            raise ApiError(400, f"{where} holds {shown(bad)}; token ids are integers in 0..{vocab - 1}",
                           param="prompt")
        return ids

    if prompt in ("", []):
        raise ApiError(400, "prompt is empty; send some text or token ids", param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if all(type(x) is int for x in prompt):
        return [tokens(prompt, "prompt")]
    if any(type(x) is int for x in prompt):
        odd = next(x for x in prompt if type(x) is not int)
        raise ApiError(400, f"prompt mixes token ids with {shown(odd)}; send token ids only, or strings only",
                       param="prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if not p:
                raise ApiError(400, f"prompt[{i}] is empty; send some text", param="prompt")
            out.append(tokenizer.encode(check_text(p, f"prompt[{i}]")))
        elif isinstance(p, list):
            out.append(tokens(p, f"prompt[{i}]"))
        else:
            raise ApiError(400, f"prompt[{i}] is {shown(p)}; a prompt is a string, a list of strings, a list of "
                                "token ids or a list of token-id lists", param="prompt")
    return out


def completion_request(body: dict, limits: Limits, tokenizer, vocab: int, context: int,
                       served: list[str]) -> Generation:
    req = validated(CompletionBody, body)
    check_model(req.model, served)
    n, best_of = check_counts(req.n, req.best_of, req.logprobs, limits)
    if req.stream and best_of > n:
        raise ApiError(400, "best_of cannot be used with stream (the best sequences are known only at the end)",
                       param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens 0 generates nothing; it is allowed only with echo (to score a prompt)",
                       param="max_tokens")
    gen = Generation(prompts=prompt_ids(req.prompt, tokenizer, vocab), max_tokens=[],
                     sampling=sampling_params(req, vocab, req.logprobs if best_of == n else (req.logprobs or 0)),
                     stop=stop_strings(req.stop, limits), n=n, best_of=best_of, stream=bool(req.stream),
                     include_usage=bool(req.stream_options and req.stream_options.include_usage),
                     echo=bool(req.echo), logprobs=req.logprobs,
                     prompt_logprobs=req.logprobs if req.echo else None, grammar=requested_grammar(req))
    fit_context(gen, req.max_tokens, limits, context, "max_tokens")
    return gen


class Message(Strict):
    role: str
    content: str | list[dict] | None = None     # text, or content parts (text, and image_url for a vision model)
    name: str | None = None


class ChatBody(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)


ROLES = ("system", "developer", "user", "assistant")


def _part(part, where: str, read_image, images: list) -> dict:
    """One content part as a chat template reads it: {"type": "text", "text"} or {"type": "image"} (its image
    read into `images`)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and set(part) == {"type", "text"} and isinstance(part["text"], str):
        return {"type": "text", "text": check_text(part["text"], where)}
    if kind == "image_url" and read_image is not None and set(part) == {"type", "image_url"}:
        url = part["image_url"]
        url = url.get("url") if isinstance(url, dict) and set(url) <= {"url", "detail"} else url
        images.append(read_image(url, where))
        return {"type": "image"}
    if kind in ("image_url", "input_image", "image") and read_image is None:
        raise ApiError(400, f"{where} is an image; this server's model takes text only", param=where)
    accepted = '{"type": "text", "text": "..."}' + \
        (' and {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}' if read_image else "")
    raise ApiError(400, f"{where} is {shown(part)}; the content parts taken are {accepted}", param=where)


def chat_messages(messages: list, read_image=None, images: list | None = None) -> list[dict]:
    """The messages as a chat template reads them: role and text content (text parts joined); developer is
    OpenAI's newer name for system. With `read_image` (a vision model's media.ImageReader.url), a message with
    image parts keeps its parts as a list, text and {"type": "image"}, the images read into `images` in order."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role {shown(m.role)} is not one of {', '.join(ROLES)} (tools are "
                                "not supported)", param=f"messages[{i}].role")
        if isinstance(m.content, str) or not m.content:
            content = check_text(m.content or "", f"messages[{i}].content")
        else:
            parts = [_part(p, f"messages[{i}].content[{j}]", read_image, images) for j, p in enumerate(m.content)]
            content = "".join(p["text"] for p in parts) if all(p["type"] == "text" for p in parts) else parts
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if getattr(m, "name", None) is not None:
            message["name"] = check_text(m.name, f"messages[{i}].name")
        out.append(message)
    return out


def chat_request(body: dict, limits: Limits, render, vocab: int, context: int, served: list[str],
                 read_image=None) -> Generation:
    """`render(messages, images)` is the chat template: messages -> (token ids, media.Media or None);
    `read_image`: a vision model's image reader (media.ImageReader.url), else None (images are refused)."""
    req = validated(ChatBody, body)
    check_model(req.model, served)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    n, _ = check_counts(req.n, None, req.top_logprobs, limits)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, f"max_tokens {req.max_tokens} and max_completion_tokens {req.max_completion_tokens} "
                            "differ; send one", param="max_completion_tokens")
    asked = req.max_completion_tokens or req.max_tokens
    images: list = []
    prompt, media = render(chat_messages(req.messages, read_image, images), images)
    gen = Generation(prompts=[prompt], max_tokens=[], media=[media],
                     sampling=sampling_params(req, vocab, (req.top_logprobs or 0) if req.logprobs else None),
                     stop=stop_strings(req.stop, limits), n=n, best_of=n, stream=bool(req.stream),
                     include_usage=bool(req.stream_options and req.stream_options.include_usage),
                     logprobs=(req.top_logprobs or 0) if req.logprobs else None, grammar=requested_grammar(req))
    fit_context(gen, asked, limits, context, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
    return gen
