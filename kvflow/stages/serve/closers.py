"""Closers: what a server opened, closed in reverse order, each failure logged (never raised)
so that one broken resource does not keep the others open."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Closers:
    def __init__(self) -> None:
        self._closers: list[Callable[[], object]] = []

    def add(self, closer: Callable[[], object]) -> None:
        self._closers.append(closer)

    def close_all(self) -> None:
        """Run every closer, last added first. Idempotent."""
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception:
                logger.exception("closing %r failed", closer)
