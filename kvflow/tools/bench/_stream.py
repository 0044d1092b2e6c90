"""One streamed OpenAI request, timed as a user sees it: ``/v1/completions`` with a prompt, or
``/v1/chat/completions`` with messages; the time to the first text, the mean time between
the later pieces, the output tokens, the text and the prompt tokens the server said it had
cached (``usage.prompt_tokens_details.cached_tokens``, when it says)."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    """One request: ``status`` 200 when served (``ttft_s``, ``tpot_s`` set), else its HTTP
    status, ``conn`` or ``stream-CODE``. ``gaps``: the seconds between consecutive pieces of
    text as they arrived (each a token, where the server streams one a chunk). ``error``:
    what a ``conn`` outcome's connection raised (its type and message)."""

    status: str
    ttft_s: float = 0.0
    tpot_s: float | None = None
    tokens: int = 0
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    gaps: tuple[float, ...] = ()
    error: str = ""


async def one_request(
    session: Any,
    url: str,
    model: str,
    prompt: str | list[dict[str, str]],
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> Outcome:
    """Stream one completion (``prompt`` a string) or chat completion (a list of messages)
    with ``ignore_eos`` and ``extra`` body fields (e.g. ``{"temperature": 0}``)."""
    import aiohttp

    chat = not isinstance(prompt, str)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    body["messages" if chat else "prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(str(resp.status))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome(f"stream-{event['error'].get('code', 'error')}")
                usage = event.get("usage") or usage
                piece = _piece(event, chat)
                if piece:
                    arrivals.append(time.perf_counter())
                    pieces.append(piece)
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return Outcome("conn", error=f"{type(e).__name__}: {e}".rstrip(": "))
    if not arrivals:
        return Outcome("empty")
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        "200",
        arrivals[0] - start,
        tpot,
        int(usage.get("completion_tokens") or 0) or len(arrivals),
        "".join(pieces),
        usage.get("prompt_tokens"),
        details.get("cached_tokens"),
        tuple(b - a for a, b in itertools.pairwise(arrivals)),
    )


def _piece(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        return str((choices[0].get("delta") or {}).get("content") or "")
    return str(choices[0].get("text") or "")
