"""kvdb: one node's tiered block store (DRAM pool over an SSD engine) and its client API.

See README.md in this folder for the layers, configuration and API.
"""

from __future__ import annotations

from kvflow.kvdb.client import EmbeddedClient, KVClient
from kvflow.kvdb.config import StoreConfig
from kvflow.kvdb.errors import (
    BlockPinnedError,
    ChecksumError,
    IncompatibleDataDirError,
    InvalidBufferError,
    InvalidKeyError,
    KVDBError,
    NamespaceMismatchError,
    NotPinnedError,
    StorageEngineError,
    StoreClosedError,
    StoreFullError,
    ValueSizeError,
)
from kvflow.kvdb.events import BlockEvent, BlockRemoved, BlockStored
from kvflow.kvdb.keys import BlockKey, KVLayout, Namespace, block_keys, next_key
from kvflow.kvdb.metadata_sync import MetadataSync
from kvflow.kvdb.replicas import LocalReplicas, MetadataReplicas, ReplicaCounter
from kvflow.kvdb.shard import Shard
from kvflow.kvdb.stats import StoreStats, TierStats
from kvflow.kvdb.store import Store, open_store, single_replica_metadata
from kvflow.replication import NodeId, Tier

__all__ = [
    "BlockEvent",
    "BlockKey",
    "BlockPinnedError",
    "BlockRemoved",
    "BlockStored",
    "ChecksumError",
    "EmbeddedClient",
    "IncompatibleDataDirError",
    "InvalidBufferError",
    "InvalidKeyError",
    "KVClient",
    "KVDBError",
    "KVLayout",
    "LocalReplicas",
    "MetadataReplicas",
    "MetadataSync",
    "Namespace",
    "NamespaceMismatchError",
    "NodeId",
    "NotPinnedError",
    "ReplicaCounter",
    "Shard",
    "StorageEngineError",
    "Store",
    "StoreClosedError",
    "StoreConfig",
    "StoreFullError",
    "StoreStats",
    "Tier",
    "TierStats",
    "ValueSizeError",
    "block_keys",
    "next_key",
    "open_store",
    "single_replica_metadata",
]
