"""What a completion request may be: the server's limits, the body's fields, and the 4xx answer for each way a
request can be wrong. A refusal names the field, the rule and the fix (clients read these messages)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse


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

    def stop_strings(self) -> list[str]:
        """`stop` as a list; an empty string would stop before the first token, so it is dropped."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """OpenAI's error shape: {"error": {"message", "type"}}."""
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class Refused(Exception):
    """A request answered with an error instead of a completion; `response()` is that answer."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.kind)


def explain(e: ValidationError) -> str:
    """Every field pydantic refused, where it is, why, and what was sent."""
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


async def read_body(http: HTTPRequest, limits: Limits) -> bytes:
    """The body, refused (413) beyond the limit: by its declared length before reading it, and by its real one
    after (a client may send no Content-Length, or a wrong one)."""
    size = http.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
        raise Refused(413, f"request body of {size} bytes exceeds the limit of {limits.max_body_bytes}; "
                           "send a shorter prompt (or raise --max-body-bytes)")
    body = await http.body()
    if len(body) > limits.max_body_bytes:
        raise Refused(413, f"request body of {len(body)} bytes exceeds the limit of {limits.max_body_bytes}")
    return body


def parse_completion(body: bytes, limits: Limits) -> Completion:
    """The body as a Completion, within this server's max_tokens (400 otherwise)."""
    try:
        req = Completion.model_validate(json.loads(body))
    except json.JSONDecodeError as e:
        raise Refused(400, f"the body is not JSON ({e}); send {{\"prompt\": \"...\", \"max_tokens\": 16}}") from e
    except ValidationError as e:
        raise Refused(400, explain(e)) from e
    if req.max_tokens > limits.max_tokens:
        raise Refused(400, f"max_tokens {req.max_tokens} exceeds this server's limit of {limits.max_tokens}; "
                           "ask for fewer")
    return req


async def read_completion(http: HTTPRequest, limits: Limits, tokenizer, context: int) -> tuple[Completion, list[int]]:
    """(the request, its prompt's token ids), or Refused: the body's size, its fields, then whether prompt and
    new tokens fit the `context` of a cache slot (only the tokenizer can tell)."""
    req = parse_completion(await read_body(http, limits), limits)
    ids = tokenizer.encode(req.prompt)
    if len(ids) + req.max_tokens > context:
        raise Refused(400, f"prompt of {len(ids)} tokens + max_tokens {req.max_tokens} exceeds the context of "
                           f"{context} tokens; shorten the prompt or ask for fewer tokens")
    return req, ids
