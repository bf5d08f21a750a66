"""Every answer that is not a completion: OpenAI's error shape, {"error": {"message", "type", "param", "code"}}
(Ollama's routes answer {"error": message}, the shape its clients read), and the handlers that give routing
errors (404, 405) and the server's own bugs (500) that shape too instead of Starlette's text/plain.

A message names the field, the rule and the fix; a value a client sent is shown through `shown` (ASCII,
shortened), so an error can always be encoded, whatever bytes or surrogates the request held.
"""

from __future__ import annotations

import logging
import re

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

log = logging.getLogger("bunsan.serve")

KIND_OF_STATUS = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                  408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def shown(value, limit: int = 60) -> str:
    """A client's value in a message: its ASCII repr, cut to `limit` characters."""
    text = ascii(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


class ApiError(Exception):
    """A request answered with an error instead of a completion. `param` names the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return KIND_OF_STATUS.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def ollama_response(self) -> JSONResponse:
        return JSONResponse({"error": self.message}, status_code=self.status)


UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*)$")   # pydantic's union branches


def explain(e: ValidationError) -> ApiError:
    """A 400 naming every field pydantic refused, where it is, why, and what was sent (a field of several
    allowed types says them all in one part)."""
    reasons: dict[str, list[str]] = {}
    sent: dict[str, object] = {}
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"] if not UNION_TAG.match(str(x))) or "body"
        if err["type"] == "extra_forbidden":
            rule = "not a parameter this server knows; remove it"
        elif err["msg"].startswith("Input should be "):
            rule = "should be " + err["msg"].removeprefix("Input should be ")
        else:
            rule = err["msg"]
        reasons.setdefault(where, []).append(rule)
        sent.setdefault(where, err.get("input"))
    parts = [f"{where}: {' or '.join(dict.fromkeys(rules))}" +
             ("" if rules[0].startswith("not a parameter") else f" (got {shown(sent[where])})")
             for where, rules in reasons.items()]
    return ApiError(400, "; ".join(parts), param=next(iter(reasons)))


async def http_error(request: HTTPRequest, exc: HTTPException) -> JSONResponse:
    """Starlette's routing errors (no such route, wrong method) in OpenAI's shape."""
    if exc.status_code == 404:
        message = f"no route {request.url.path}; this server answers /v1/completions, /v1/chat/completions, " \
                  "/v1/models, /api/generate, /api/chat, /api/tags and /health"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; use {exc.headers.get('Allow', 'POST')}" \
            if exc.headers else f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return ApiError(exc.status_code, message, code=str(exc.status_code)).response()


async def server_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
    """A bug of this server (never a client's input): logged with its traceback, answered as a 500."""
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()
