"""A :class:`~kvflow.router.index.HolderPrefixIndex` over the replicated metadata.

Which prefill instance holds which block is what the metadata group records (``node -> tier``
per key), so a cluster's router reads its prefix matches from a read-only
:class:`~kvflow.replication.MetadataReader` (an in-process ``MetadataView`` or the gRPC
``RemoteMetadataView`` with its holders cache). A block counts whichever tier holds it: a
prefill instance loads an SSD block before it computes.

``match_holders`` (what the conductor calls) and ``match_all`` read the request's keys' holders
in ONE ``holders`` call (one lock, or at most one RPC) and walk them once; ``match`` is the
single-instance form and costs the same call, so a caller with many instances should use one of
the other two.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.replication import MetadataReader
from kvflow.router.index import prefix_lengths, walk_holders


class MetadataPrefixIndex:
    """router.PrefixIndex (and BatchPrefixIndex, HolderPrefixIndex) from the metadata.
    Thread-safe when ``view`` is (both metadata views are). Holds no state of its own."""

    def __init__(self, view: MetadataReader) -> None:
        self._view = view

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        return self.match_all([instance_id], keys)[0]

    def match_holders(self, keys: Sequence[bytes]) -> dict[str, int]:
        """See :class:`~kvflow.router.index.HolderPrefixIndex` (one ``holders`` call)."""
        if not keys:
            return {}
        return prefix_lengths(self._view.holders(list(keys)))

    def match_all(self, instance_ids: Sequence[str], keys: Sequence[bytes]) -> list[int]:
        if not keys or not instance_ids:
            return [0] * len(instance_ids)
        return walk_holders(instance_ids, self._view.holders(list(keys)))
