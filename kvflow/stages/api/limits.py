"""Limits checked before work: the size of a prompt before it is tokenized, and a bounded
pool that tokenizes off the event loop.

A 10 MB prompt used to be tokenized on the event loop before any length check (15 s during
which no other request moved); now a prompt is measured in bytes first, and tokenizing runs
on at most ``workers`` threads with at most ``queue`` calls waiting, the rest refused at once
(RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvflow.stages.errors import InvalidArgument, NoCapacity

MAX_PROMPT_BYTES = 1 << 20
"""The largest prompt accepted, in UTF-8 bytes (Generate and Tokenize alike)."""


def check_prompt_bytes(text: str, limit: int = MAX_PROMPT_BYTES) -> None:
    """InvalidArgument when ``text`` is over ``limit`` UTF-8 bytes. Costs O(limit) at most: a
    text longer than ``limit`` characters is refused without encoding it."""
    size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise InvalidArgument(f"prompt of {size} bytes is over the limit of {limit} bytes")


class TokenizerPool:
    """Runs ``tokenizer.encode_prompt`` (BOS where the tokenizer adds one) on ``workers``
    threads; ``encode`` raises NoCapacity when
    ``queue`` calls already wait. Thread-safe to call from one event loop; ``close`` waits for
    running calls."""

    def __init__(self, tokenizer: Any, workers: int = 2, queue: int = 64) -> None:
        if workers < 1 or queue < 1:
            raise ValueError("workers and queue: must be >= 1")
        self._tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvflow-tok")
        self._capacity = workers + queue
        self._pending = 0

    async def encode(self, text: str) -> Sequence[int]:
        if self._pending >= self._capacity:
            raise NoCapacity(f"tokenizer busy: {self._pending} calls in flight")
        self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, self._tokenizer.encode_prompt, text)
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
