"""The streamed answer of the recording HTTP servers that the load benchmark's tests run on
127.0.0.1: a two-token OpenAI completion, then its usage and ``[DONE]``."""

from __future__ import annotations

import json

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
