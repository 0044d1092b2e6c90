"""kvdb for other engines: an SGLang HiCache storage backend and a Mooncake Store-compatible
Python API, both over a ``ClusterMember`` (a kvdb shard that joins a kvflow cluster).

Importing this package loads neither sglang nor torch; ``kvflow.integrations.sglang_hicache``
imports SGLang's storage contract when SGLang loads it. See README.md in this folder.
"""

from __future__ import annotations

from kvflow.integrations.config import MemberConfig
from kvflow.integrations.member import MEMBER_KIND, ClusterMember, MemberCounters, Misses

__all__ = ["MEMBER_KIND", "ClusterMember", "MemberConfig", "MemberCounters", "Misses"]
