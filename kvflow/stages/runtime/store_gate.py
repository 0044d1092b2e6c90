"""StoreGate: a colocated engine's prompt stores wait while another prompt is being prefilled.

On a colocated engine (one engine prefills and decodes, every core) a prompt's completed
blocks are stored in one batch after its first token (``prefill.py:HeldStores``). The store
copies them into the kvdb DRAM tier on an executor thread beside the engine's OpenMP team; on
a fresh server that is the first write of those tier pages, which on the 2-core development
VM cost 0.5-1.8 s of CPU per GiB on quiet cores and 8-9 us a 4 KiB page beside a busy engine
(docs/performance.md, "Stores wait for the other prompts' first tokens" and "What remains").
When eight long prompts arrive at once, the first ones' stores took those cores from the
prompts still waiting for their first token.

So the stores wait while any prompt admitted to the same engine has not had its first token
yet, until their own request is ending (its decode is over, or it failed: its end waits for
them), and at most ``MAX_WAIT_S``. Only admitted prompts count: they hold their pages and
make progress, so a prompt that waits for pages (which the waiting stores' requests release
once stored and finished) never holds the gate shut. Nothing is lost by waiting: the blocks stay
in the request's pages, which the decode holds until the stores are done, and a concurrent
request with the same prefix shares those pages by key in the engine.

All calls come from the server's event loop (the prefill stage's consumer).
"""

from __future__ import annotations

import asyncio
import time

MAX_WAIT_S = 20.0
"""The longest a prompt's stores wait for the gate: under a steady stream of prompts they
are taken anyway after this long."""


class StoreGate:
    """Counts the prompts being prefilled on one engine; ``wait`` until there are none."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self._prefilling = 0
        self._open = asyncio.Event()
        self._open.set()

    @property
    def prefilling(self) -> int:
        """Prompts admitted to the engine that have not had their first token yet."""
        return self._prefilling

    def enter(self) -> None:
        """A prompt was admitted to the engine (its pages allocated)."""
        self._prefilling += 1
        self._open.clear()

    def leave(self) -> None:
        """That prompt had its first token, finished or failed (once per ``enter``)."""
        if self._prefilling <= 0:
            raise RuntimeError("StoreGate.leave without a matching enter")
        self._prefilling -= 1
        if self._prefilling == 0:
            self._open.set()

    async def wait(self, due: asyncio.Event | None = None) -> float:
        """Return once no prompt is being prefilled, once ``due`` is set (the waiting
        stores' request is ending: its end waits for them), or after ``max_wait_s``; the
        seconds waited."""
        if self._open.is_set() or (due is not None and due.is_set()):
            return 0.0
        started = time.monotonic()
        waits = [asyncio.ensure_future(self._open.wait())]
        if due is not None:
            waits.append(asyncio.ensure_future(due.wait()))
        try:
            await asyncio.wait(waits, timeout=self.max_wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return time.monotonic() - started
