"""The streamed answer of the recording HTTP servers that the load benchmark's tests run on
127.0.0.1: a two-token OpenAI completion, then its usage and ``[DONE]``."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web


async def two_token_completion(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in ("a", "b"):
        event = {"choices": [{"index": 0, "text": piece}]}
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve_completions(handler: Handler) -> tuple[web.AppRunner, int]:
    """An HTTP server on 127.0.0.1 (a free port) answering ``/v1/completions`` with
    ``handler``: its runner (``cleanup()`` stops it) and its port."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
