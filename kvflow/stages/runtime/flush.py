"""Flushing a shard's cache: every block removed except the pinned ones (SGLang's
/flush_cache, on a node)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvflow.kvdb import BlockPinnedError, Shard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlushResult:
    """Blocks removed, and blocks kept because they were pinned."""

    removed: int
    pinned: int


def remove_unpinned(shard: Shard) -> FlushResult:
    """Remove every block of ``shard`` (every tier) that holds no pin. Blocking: call it from
    a thread. Safe while requests run: a block a request pinned (reuse-load reads it) or a
    warm-up job pinned stays; a block stored meanwhile may stay. The shard's outbox gets a
    removal event per block, as for any removal, so the metadata follows."""
    removed = pinned = 0
    for key, _tier in shard.holdings():
        try:
            removed += bool(shard.remove(key))
        except BlockPinnedError:
            pinned += 1
    logger.info("cache flushed: removed=%s pinned=%s", removed, pinned)
    return FlushResult(removed, pinned)
