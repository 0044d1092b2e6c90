"""kvdb: one node's tiered block store (DRAM pool over an SSD engine) and its client API.

See README.md in this folder for the layers, configuration and API.
"""

from __future__ import annotations

from kvflow.kvdb.admin import (
    AdminSource,
    KVAdmin,
    ShardRef,
    StaticAdminSource,
    add_admin_service,
)
from kvflow.kvdb.client import EmbeddedClient, KVClient
from kvflow.kvdb.config import StoreConfig
from kvflow.kvdb.entry import BlockInfo
from kvflow.kvdb.errors import (
    AccessDeniedError,
    BlockPinnedError,
    ChecksumError,
    IncompatibleDataDirError,
    InvalidBufferError,
    InvalidKeyError,
    InvalidRequestError,
    KVDBError,
    NamespaceMismatchError,
    NotEnoughReplicasError,
    NotPinnedError,
    RemoteReadError,
    StorageEngineError,
    StoreClosedError,
    StoreFullError,
    UnknownShardError,
    ValueSizeError,
)
from kvflow.kvdb.events import BlockEvent, BlockRemoved, BlockStored
from kvflow.kvdb.fanout import AdminPeer, AdminPeers
from kvflow.kvdb.keys import (
    DEFAULT_TENANT,
    BlockKey,
    KVLayout,
    Namespace,
    block_keys,
    check_tenant,
    next_key,
)
from kvflow.kvdb.metadata_sync import MetadataSync
from kvflow.kvdb.proto import ADMIN_SERVICE_NAME, BLOCK_SERVICE_NAME
from kvflow.kvdb.remote.config import BlockServiceConfig, RemoteClientConfig
from kvflow.kvdb.remote.dram_lease import HotBlock, LeasedBlock
from kvflow.kvdb.remote.peer_budget import PeerBreakers, PeerCallBudget
from kvflow.kvdb.remote.reader import RemoteClient
from kvflow.kvdb.remote.replica_writer import BlockToCopy, ReplicaWriter
from kvflow.kvdb.remote.server import BlockServer, add_block_service, segment_name
from kvflow.kvdb.remote.types import RemoteBlock, RemoteLease, RemoteStats
from kvflow.kvdb.replicas import LocalReplicas, MetadataReplicas, ReplicaCounter
from kvflow.kvdb.shard import Shard
from kvflow.kvdb.stats import StoreStats, TenantUsage, TierStats
from kvflow.kvdb.store import Store, open_store, single_replica_metadata
from kvflow.kvdb.viewer import Viewer
from kvflow.replication import NodeId, Tier

__all__ = [
    "ADMIN_SERVICE_NAME",
    "BLOCK_SERVICE_NAME",
    "DEFAULT_TENANT",
    "AccessDeniedError",
    "AdminPeer",
    "AdminPeers",
    "AdminSource",
    "BlockEvent",
    "BlockInfo",
    "BlockKey",
    "BlockPinnedError",
    "BlockRemoved",
    "BlockServer",
    "BlockServiceConfig",
    "BlockStored",
    "BlockToCopy",
    "ChecksumError",
    "EmbeddedClient",
    "HotBlock",
    "IncompatibleDataDirError",
    "InvalidBufferError",
    "InvalidKeyError",
    "InvalidRequestError",
    "KVAdmin",
    "KVClient",
    "KVDBError",
    "KVLayout",
    "LeasedBlock",
    "LocalReplicas",
    "MetadataReplicas",
    "MetadataSync",
    "Namespace",
    "NamespaceMismatchError",
    "NodeId",
    "NotEnoughReplicasError",
    "NotPinnedError",
    "PeerBreakers",
    "PeerCallBudget",
    "RemoteBlock",
    "RemoteClient",
    "RemoteClientConfig",
    "RemoteLease",
    "RemoteReadError",
    "RemoteStats",
    "ReplicaCounter",
    "ReplicaWriter",
    "Shard",
    "ShardRef",
    "StaticAdminSource",
    "StorageEngineError",
    "Store",
    "StoreClosedError",
    "StoreConfig",
    "StoreFullError",
    "StoreStats",
    "TenantUsage",
    "Tier",
    "TierStats",
    "UnknownShardError",
    "ValueSizeError",
    "Viewer",
    "add_admin_service",
    "add_block_service",
    "block_keys",
    "check_tenant",
    "next_key",
    "open_store",
    "segment_name",
    "single_replica_metadata",
]
