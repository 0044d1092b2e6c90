"""SharedLoads: requests that reuse the same prefix at the same time read it from kvdb once.

reuse-load reads a request's cached prefix into page buffers, which the prefill engine copies
into its pool when it admits the request (or shares by block key, where a live page already
holds the block). Requests that arrive together with one prefix (the questions after one
system prompt) each read the same blocks: 8 such requests after a 1,500-token prefix read
~69 MB eight times, on the cores the engine's step runs on, and the engine began its step
with the few whose reads had finished.

Here the first request of a prefix reads it (the leader); a request whose prefix is the same
(the same last block key, so the same chain before it) that arrives while that read runs, or
while any request still holds its buffers, takes the same buffers instead of reading. The
buffers are read-only for everyone; they go back (``release`` of the read, e.g. the staging
lease) when the last holder lets go (``LoadShare.release``, once its engine admitted it, or
on failure). A follower of a read that failed reads for itself.

Thread-safe: ``load`` may be awaited from any event loop; ``release`` called from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from kvflow.kvdb import Tier

Read = tuple[list[Any], list[Tier | None], Callable[[], None]]
"""What a prefix read gives: the page buffers, each block's tier (None: missing, e.g. it failed
its checksum), and the function that frees the buffers."""


@dataclass
class _Flight:
    done: concurrent.futures.Future[Read] = field(default_factory=concurrent.futures.Future)
    holders: int = 1


class LoadShare:
    """One request's hold on a shared read's buffers; ``release`` (idempotent) lets go."""

    def __init__(self, loads: SharedLoads, key: Hashable, flight: _Flight) -> None:
        self._loads = loads
        self._key = key
        self._flight: _Flight | None = flight

    def release(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            self._loads._let_go(self._key, flight)


class SharedLoads:
    """Reads of a prefix by key, shared by the requests that want it at the same time.
    ``reads`` (leaders) and ``joins`` (followers that took a leader's buffers) count since
    start."""

    def __init__(self) -> None:
        self._flights: dict[Hashable, _Flight] = {}
        self._lock = threading.Lock()
        self.reads = 0
        self.joins = 0

    async def load(self, key: Hashable, read: Callable[[], Read]) -> tuple[Read, LoadShare, bool]:
        """The buffers of ``key``'s prefix: a running or held read's, else ``read()`` (run in a
        thread). Returns (the read, this caller's hold, whether this caller did the read). The
        caller releases the hold; an exception of its own read propagates, a leader's failure
        makes a follower read for itself. A caller cancelled while the read runs lets go of
        it; the read goes on for the others (its buffers go back when it ends, if nobody
        holds them)."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                flight.holders += 1
        if flight is not None:
            try:
                got, share = await self._wait(LoadShare(self, key, flight), flight)
            except Exception:  # the leader's read failed: it is that request's error
                pass
            else:
                with self._lock:
                    self.joins += 1
                return got, share, False
        flight = _Flight()
        with self._lock:
            # a failed read's key stays listed until its holders let go: read unshared then
            mine = key not in self._flights
            if mine:
                self._flights[key] = flight
            self.reads += 1

        def run() -> None:
            try:
                flight.done.set_result(read())
            except BaseException as exc:
                flight.done.set_exception(exc)

        asyncio.get_running_loop().run_in_executor(None, run)
        got, share = await self._wait(LoadShare(self, key if mine else object(), flight), flight)
        return got, share, True

    @staticmethod
    async def _wait(share: LoadShare, flight: _Flight) -> tuple[Read, LoadShare]:
        """The flight's read once done (a waiter's cancellation never cancels the read); on
        any exception the hold is let go."""
        try:
            return await asyncio.shield(asyncio.wrap_future(flight.done)), share
        except BaseException:
            share.release()
            raise

    def _let_go(self, key: Hashable, flight: _Flight) -> None:
        with self._lock:
            flight.holders -= 1
            if flight.holders:
                return
            if self._flights.get(key) is flight:
                del self._flights[key]
        # the last holder: the buffers go back, now or when the read ends
        flight.done.add_done_callback(_free)

    def held(self) -> int:
        """Prefixes whose buffers some request holds (or is reading) now."""
        with self._lock:
            return len(self._flights)


def _free(done: concurrent.futures.Future[Read]) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result()[2]()
