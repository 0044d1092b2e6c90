"""Pure data of the metadata group: tiers, node ids and node records.

The lowest layer that needs a type defines it: block keys are opaque ``bytes`` here;
``Tier`` and ``NodeId`` are defined here and re-exported by kvdb.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NewType

NodeId = NewType("NodeId", str)
"""The stable name of a kvdb node (a shard holder), e.g. ``"node-0"``."""


class Tier(Enum):
    """The storage tier a replica lives in. The value is the compact wire/journal form."""

    DRAM = 0
    SSD = 1


TIERS_BY_VALUE: tuple[Tier, ...] = (Tier.DRAM, Tier.SSD)
"""``TIERS_BY_VALUE[t.value] is t`` for every tier: a list lookup instead of ``Tier(v)``."""


@dataclass(frozen=True)
class NodeInfo:
    """One member node as the metadata records it (an immutable snapshot).

    ``address`` and ``kind`` are empty strings for a node that was registered implicitly by a
    write (see :meth:`MetadataTable.record_batch`). Times are the callers' ``now`` values
    (seconds, the same clock for every caller of one group).
    """

    node: NodeId
    address: str
    kind: str
    registered_at: float
    last_heartbeat: float
    num_blocks: int
