"""Replicated metadata: which node holds which block in which tier (Raft on pysyncobj).

Imports nothing of the project. Keys are opaque ``bytes``; ``Tier`` and ``NodeId`` are
defined here and re-exported by kvdb. See README.md in this folder.
"""

from __future__ import annotations

from kvflow.replication.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvflow.replication.config import MetadataConfig
from kvflow.replication.errors import (
    MetadataTimeoutError,
    MetadataUnavailableError,
    NotLeaderError,
    ReplicationError,
)
from kvflow.replication.group import MetadataGroup
from kvflow.replication.placement import NodeLoad, choose_source, choose_targets
from kvflow.replication.protocols import MetadataClient, MetadataReader
from kvflow.replication.remote import RemoteMetadata
from kvflow.replication.remote_view import RemoteMetadataView
from kvflow.replication.table import DEFAULT_REPLICA_TARGET, MetadataTable
from kvflow.replication.types import NodeId, NodeInfo, Tier
from kvflow.replication.view import MetadataView

__all__ = [
    "DEFAULT_REPLICA_TARGET",
    "BreakerConfig",
    "BreakerState",
    "CircuitBreaker",
    "MetadataClient",
    "MetadataConfig",
    "MetadataGroup",
    "MetadataReader",
    "MetadataTable",
    "MetadataTimeoutError",
    "MetadataUnavailableError",
    "MetadataView",
    "NodeId",
    "NodeInfo",
    "NodeLoad",
    "NotLeaderError",
    "RemoteMetadata",
    "RemoteMetadataView",
    "ReplicationError",
    "Tier",
    "choose_source",
    "choose_targets",
]
