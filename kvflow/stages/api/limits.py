"""Limits checked before work: the size of a prompt before it is tokenized, a bounded pool
that tokenizes off the event loop, and each tenant's concurrency and rate (``TenantLimits``,
the one place every front's requests are admitted: ``generation.Generation``).

A 10 MB prompt used to be tokenized on the event loop before any length check (15 s during
which no other request moved); now a prompt is measured in bytes first, and tokenizing runs
on at most ``workers`` threads with at most ``queue`` calls waiting, the rest refused at once
(RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvflow.stages.errors import InvalidArgument, NoCapacity, RateLimited

logger = logging.getLogger(__name__)

MAX_BUCKETS = 4096
"""Token buckets kept at most; beyond it full ones (idle tenants) are forgotten."""


MESSAGE_OVERHEAD_BYTES = 64 << 10
"""A Generate message's room besides its prompt: stop strings, sampling, ids, metadata."""
TOKEN_ID_BYTES = 5
"""The most one token id takes on the wire (a uint32 varint)."""


def max_message_bytes(max_prompt_bytes: int, max_model_len: int, upload_bytes: int = 0) -> int:
    """The largest gRPC message the inference server receives, derived from the prompt limit:
    a prompt of ``max_prompt_bytes`` or ``max_model_len`` token ids plus the rest of the
    message (at least ``upload_bytes``: a warm-up corpus file). gRPC refuses a larger one
    (RESOURCE_EXHAUSTED) from its length prefix, before it is allocated."""
    prompt = max(max_prompt_bytes, TOKEN_ID_BYTES * max_model_len)
    return max(prompt + MESSAGE_OVERHEAD_BYTES, upload_bytes)


def check_prompt_bytes(text: str, limit: int) -> None:
    """InvalidArgument when ``text`` is over ``limit`` UTF-8 bytes (``max_prompt_bytes`` of
    the routing config). Costs O(limit) at most: a text longer than ``limit`` characters is
    refused without encoding it."""
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


@dataclass
class _Bucket:
    tokens: float
    at: float


class TenantPermit:
    """One admitted request's place in its tenant's concurrency count. ``release`` is
    idempotent (call it when the request ended, however it ended)."""

    def __init__(self, limits: TenantLimits, tenant: str) -> None:
        self._limits = limits
        self.tenant = tenant
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self.tenant)


class TenantLimits:
    """Admission per tenant: at most ``max_concurrency`` requests in flight and a token
    bucket refilled at ``rate_per_s`` holding at most ``burst`` (None: no such limit).

    ``admit(tenant)`` returns a TenantPermit or raises RateLimited naming the config field
    over its limit (``tenant_max_concurrency`` or ``tenant_rate_per_s``) and when a retry
    could succeed. A request refused for concurrency takes no token. Not thread-safe: call
    from the one event loop of the fronts. ``clock`` is injected (monotonic seconds)."""

    def __init__(
        self,
        max_concurrency: int | None = None,
        rate_per_s: float | None = None,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.rate_per_s = rate_per_s
        self.burst = burst or max(1, math.ceil(rate_per_s or 1))
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    @classmethod
    def from_config(cls, config: Any) -> TenantLimits:
        """From a RoutingConfig's ``tenant_max_concurrency``, ``tenant_rate_per_s`` and
        ``tenant_burst``."""
        return cls(config.tenant_max_concurrency, config.tenant_rate_per_s, config.tenant_burst)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def admit(self, tenant: str) -> TenantPermit:
        n = self._in_flight.get(tenant, 0)
        if self.max_concurrency is not None and n >= self.max_concurrency:
            logger.info("tenant=%s refused: %d requests in flight", tenant, n)
            raise RateLimited(
                f"tenant {tenant!r} has {n} requests in flight: the limit "
                f"(tenant_max_concurrency) is {self.max_concurrency}",
                "tenant_max_concurrency",
                1.0,
            )
        if self.rate_per_s is not None:
            self._take_token(tenant)
        self._in_flight[tenant] = n + 1
        return TenantPermit(self, tenant)

    def _take_token(self, tenant: str) -> None:
        rate, now = self.rate_per_s, self._clock()
        assert rate is not None
        bucket = self._buckets.get(tenant)
        if bucket is None:
            self._forget_idle(now)
            bucket = self._buckets[tenant] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * rate)
        bucket.at = now
        if bucket.tokens < 1.0:
            wait = (1.0 - bucket.tokens) / rate
            logger.info("tenant=%s refused: over %s/s", tenant, rate)
            raise RateLimited(
                f"tenant {tenant!r} is over its rate limit (tenant_rate_per_s) of {rate:g} "
                f"requests/s, burst {self.burst}: retry in {wait:.2f} s",
                "tenant_rate_per_s",
                wait,
            )
        bucket.tokens -= 1.0

    def _forget_idle(self, now: float) -> None:
        """Bound the buckets (a caller may name many tenants when no keys are set): drop
        those full again, which behave exactly like a new one."""
        if len(self._buckets) < MAX_BUCKETS:
            return
        rate = self.rate_per_s or 0.0
        full = [t for t, b in self._buckets.items() if b.tokens + (now - b.at) * rate >= self.burst]
        for t in full:
            del self._buckets[t]

    def _release(self, tenant: str) -> None:
        n = self._in_flight.get(tenant, 0) - 1
        if n > 0:
            self._in_flight[tenant] = n
        else:
            self._in_flight.pop(tenant, None)
