"""A request's body as a JSON object, or the 4xx saying why not: too big (413, by its Content-Length before
reading and by its bytes while reading), too slow (408: a client that announces more bytes than it sends never
holds a connection past the timeout), not UTF-8, not JSON, NaN or Infinity, nested deeper than a request can
mean, or not an object. A client that goes away while sending is `ClientGone`: nothing to answer, nothing to
log."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from bunsan.serve.errors import ApiError, shown

MAX_DEPTH = 32          # the deepest a request goes is messages[i].content[j].text: 5; 32 leaves room


class ClientGone(Exception):
    """The client closed the connection before its request was read."""


@dataclass
class BodyLimits:
    max_bytes: int = 1 << 20
    timeout_s: float = 30.0


async def _read_bytes(http: HTTPRequest, limits: BodyLimits) -> bytes:
    size = http.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limits.max_bytes:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limits.max_bytes}; send a shorter "
                            "prompt (or raise --max-body-bytes)")
    chunks, total = [], 0
    try:
        async for chunk in http.stream():
            total += len(chunk)
            if total > limits.max_bytes:      # a chunked body has no length to refuse up front
                raise ApiError(413, f"request body exceeds the limit of {limits.max_bytes} bytes; send a shorter "
                                    "prompt (or raise --max-body-bytes)")
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise ClientGone() from e
    return b"".join(chunks)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def _depth_within(value, limit: int) -> bool:
    """Whether `value` nests at most `limit` lists or objects deep (iteratively: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return False
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def parse_json(body: bytes) -> dict:
    """The body as a JSON object; 400 naming what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8: byte {body[e.start]:#04x} at offset {e.start} ({e.reason}); "
                            "send JSON encoded as UTF-8") from e
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not JSON ({e}); send an object such as "
                            '{"prompt": "Hello", "max_tokens": 16}') from e
    except RecursionError as e:
        raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels; no request field does") from e
    except ValueError as e:                   # NaN/Infinity, or an integer of more digits than Python reads
        raise ApiError(400, f"the body holds a number this server does not read: {e}") from e
    if not _depth_within(value, MAX_DEPTH):
        raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels; no request field does")
    if not isinstance(value, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(value).__name__} {shown(value)}")
    return value


async def read_json(http: HTTPRequest, limits: BodyLimits) -> dict:
    """The request's JSON object within `limits`, or ApiError (4xx), or ClientGone."""
    try:
        body = await asyncio.wait_for(_read_bytes(http, limits), limits.timeout_s)
    except asyncio.TimeoutError as e:
        raise ApiError(408, f"the body was not received within {limits.timeout_s:g} s (was its Content-Length "
                            "right?); send the whole body at once") from e
    return parse_json(body)
