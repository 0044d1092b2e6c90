"""What every HTTP route shares: reading a JSON body under a size limit, validating it into a
pydantic model with 400s that name the field, Server-Sent Events, the caller's tenant, the
text of a token for logprobs, and a non-streaming answer cancelled when its client goes away."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from kvflow.stages.api.http_errors import HttpError

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# nginx's "client closed request": the answer nobody reads, for the logs and metrics.
CLIENT_CLOSED = 499


class Body(BaseModel):
    """Base of the request models: strict types (``"5"`` is not an int), unknown fields
    ignored (clients send fields kvflow has no use for)."""

    model_config = ConfigDict(extra="ignore", strict=True)


def caller_tenant(request: Request) -> str:
    """The tenant of an HTTP caller: its API key's, as the auth middleware of the app
    (``http_app.create_app``) decided from ``Authorization: Bearer KEY`` (api/auth.py); ""
    (the default tenant) when the server runs without keys. Never a request field."""
    identity = getattr(request.state, "identity", None)
    return "" if identity is None else str(identity.tenant)


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body. 413 when Content-Length says it is over ``limit`` bytes
    (before reading any of it) or, without one, as soon as the bytes read pass it; 400 for
    a body that is not UTF-8 or not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise HttpError(400, "Content-Length is not a number") from None
        if size > limit:
            raise HttpError(413, f"request body of {size} bytes is over the limit of {limit}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise HttpError(413, f"request body is over the limit of {limit} bytes")
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HttpError(400, f"request body is not valid UTF-8: {exc.reason}") from None
    if nests_deeper(text, MAX_JSON_DEPTH):
        raise HttpError(
            400, f"request body nests deeper than the limit of {MAX_JSON_DEPTH} (max_json_depth)"
        )
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise HttpError(400, f"request body is not valid JSON: {exc}") from None


MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a request body may have: checked before the
body is parsed (Python's parser recursed into a RecursionError, a 500, at ~1,000)."""

_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def nests_deeper(text: str, limit: int) -> bool:
    """Whether the arrays and objects of ``text`` nest deeper than ``limit`` (brackets inside
    strings skipped): linear, no recursion, for any input, valid JSON or not."""
    if text.count("[") + text.count("{") <= limit:
        return False  # cannot nest deeper than it has brackets
    depth = 0
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > limit:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


def parse(model: type[M], data: Any) -> M:
    """``data`` validated as ``model``; 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise HttpError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise HttpError(400, f"{where}: {first['msg']}", param=where or None) from None


def check_text(text: str, what: str) -> str:
    """``text`` if it encodes as UTF-8 (JSON escapes can carry lone surrogates); else 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise HttpError(400, f"{what} is not valid UTF-8 (a lone surrogate)") from None
    return text


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class SseTemplate:
    """Server-Sent Events that differ only in one string: ``SseTemplate(obj)`` with SLOT as
    that string's value in ``obj`` (exactly once); ``template(text)`` is ``sse(obj)`` with
    ``text`` in the slot, byte for byte, but only ``text`` is encoded per event (a streamed
    token's event was a dict copy and a full ``json.dumps`` on the pipeline's loop)."""

    SLOT = "\x00kvflow-slot\x00"

    def __init__(self, obj: Any) -> None:
        encoded = json.dumps(obj, ensure_ascii=False).encode()
        slot = json.dumps(self.SLOT).encode()
        if encoded.count(slot) != 1:
            raise ValueError("the template must hold SseTemplate.SLOT exactly once")
        head, self._tail = encoded.split(slot)
        self._head = b"data: " + head
        self._tail += b"\n\n"

    def __call__(self, text: str) -> bytes:
        return self._head + json.dumps(text, ensure_ascii=False).encode() + self._tail


async def sse_stream(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events`` then ``data: [DONE]``; an error after the stream started (the status is
    sent) becomes one last event with the error JSON."""
    from kvflow.stages.api.http_errors import http_error_for

    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield sse(http_error_for(exc).body())
    finally:  # a client that went away closes this stream: close the request's too
        await events.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


class TokenText:
    """The text of single token ids (for logprobs), cached: ``text(id)``. Special tokens
    keep their text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        return text


async def primed(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``events`` with its first item already awaited: an error before the first item (bad
    input found by a stage, a rejection) raises here, while an HTTP status can still be
    chosen; the returned iterator yields every item, the first included."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return _empty(events)
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise
    return _chain(first, events)


async def _empty(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    return
    yield  # an async generator


async def _chain(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    try:
        yield first
        async for item in events:
            yield item
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def collect(items: AsyncIterator[T]) -> list[T]:
    """Every item of ``items``, in order."""
    return [item async for item in items]


async def until_disconnected(request: Request) -> None:
    """Returns once the client's connection is gone. Call it only after the body was read:
    the ASGI server then has nothing left to give but ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of ``work`` (a non-streaming answer being computed), run as a task that is
    cancelled when the client disconnects first; the cancel reaches the request's
    ``Generation.chunks`` (the request is ended and every page, pin and booking freed)
    before this raises HttpError(499). A streaming answer needs none of this: Starlette
    closes the stream. Errors of ``work`` propagate as they are."""

    async def run() -> T:  # a Task of our own: cancelled() says the cancel reached it
        return await work

    task = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup has run
    if task.cancelled():
        logger.info("%s %s: client went away, request cancelled", request.method, request.url.path)
        raise HttpError(CLIENT_CLOSED, "client closed the request")
    return task.result()
