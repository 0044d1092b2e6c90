"""The conductor's view of which prefill instance holds which prefix (router.PrefixIndex):
each instance's own shard in one process, or the metadata group in a cluster."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvflow.replication import NodeId
from kvflow.stages.runtime.instances import PrefillInstance


class ShardPrefixIndex:
    """router.PrefixIndex over the embedded instances' kvdb shards (thread-safe reads)."""

    def __init__(self, instances: Mapping[str, PrefillInstance]) -> None:
        self._instances = instances

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        instance = self._instances.get(instance_id)
        if instance is None:
            return 0
        return instance.match_prefix(list(keys))


class MetadataPrefixIndex:
    """router.PrefixIndex from the metadata (a router): leading keys an instance holds, any
    tier. ``metadata`` is a RemoteMetadata (its view caches holders briefly)."""

    def __init__(self, metadata: object) -> None:
        self._metadata = metadata

    def match(self, instance_id: str, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        n = 0
        node = NodeId(instance_id)
        for holders in self._metadata.view().holders(list(keys)):  # type: ignore[attr-defined]
            if node not in holders:
                break
            n += 1
        return n
