"""The per-request output channel: what stages ``emit`` and the caller iterates."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger(__name__)


class OutputChannel:
    """An unbounded FIFO of items from a request's stages to one consumer.

    Producers call ``put`` from the event loop or from any thread (an engine thread streaming
    decoded tokens); items from one thread keep their order. One consumer iterates with
    ``async for`` on the loop; when the channel is closed it first yields every buffered item,
    then stops, or raises the error it was closed with. Items put after ``close`` are dropped.
    The channel does not copy items: ownership passes to the consumer.
    """

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._put_count = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the event loop the consumer runs on; call from that loop's thread."""
        with self._lock:
            self._loop = loop
            self._loop_thread = threading.get_ident()

    def put(self, item: Any) -> bool:
        """Append ``item``; thread-safe. Returns False (and drops it) once the channel is closed."""
        with self._lock:
            if self._closed:
                logger.debug("dropping an item emitted after the channel closed")
                return False
            self._items.append(item)
            self._put_count += 1
        self._wake()
        return True

    def close(self, error: BaseException | None = None) -> None:
        """No more items; the consumer stops after the buffer, raising ``error`` if given.

        Idempotent: only the first call's error counts. Thread-safe.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._error = error
        self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def put_count(self) -> int:
        """Items accepted so far (consumed or not)."""
        return self._put_count

    def pending(self) -> int:
        """Items buffered and not yet consumed."""
        with self._lock:
            return len(self._items)

    async def get(self) -> Any:
        """The next item; raises StopAsyncIteration, or the close error, when exhausted."""
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    if self._error is not None:
                        raise self._error
                    raise StopAsyncIteration
                if self._loop is None:
                    self._loop = asyncio.get_running_loop()
                    self._loop_thread = threading.get_ident()
                waiter = self._loop.create_future()
                self._waiter = waiter
            try:
                await waiter
            finally:
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        return await self.get()

    def _wake(self) -> None:
        with self._lock:
            waiter, loop, loop_thread = self._waiter, self._loop, self._loop_thread
        if waiter is None or loop is None:
            return
        if threading.get_ident() == loop_thread:
            _resolve(waiter)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(_resolve, waiter)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
