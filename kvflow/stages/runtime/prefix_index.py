"""The conductor's view of which prefill instance holds which prefix (router.PrefixIndex) in
one process: each instance's own shard. (A router reads it from the metadata group:
``router.MetadataPrefixIndex``.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
