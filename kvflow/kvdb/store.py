"""open_store: a shard + (optionally) its metadata group and sync, opened and closed together."""

from __future__ import annotations

import logging

from kvflow.kvdb.client import EmbeddedClient
from kvflow.kvdb.config import StoreConfig
from kvflow.kvdb.keys import Namespace
from kvflow.kvdb.metadata_sync import MetadataSync
from kvflow.kvdb.remote.replica_writer import ReplicaWriter
from kvflow.kvdb.replicas import LocalReplicas, MetadataReplicas, ReplicaCounter
from kvflow.kvdb.shard import LOCAL_NODE, Shard
from kvflow.replication import MetadataConfig, MetadataGroup, NodeId

logger = logging.getLogger(__name__)

METADATA_READY_TIMEOUT_S = 10.0


class Store:
    """What ``open_store`` returns: the shard, the metadata wiring, and client factories.

    ``close()`` (idempotent) closes the shard (flushing DRAM to SSD per config), flushes the
    remaining events to the metadata, and closes the metadata group if the store created it.
    """

    def __init__(
        self,
        shard: Shard,
        namespace: Namespace | None,
        metadata: MetadataGroup | None,
        sync: MetadataSync | None,
        owns_metadata: bool,
    ) -> None:
        self.shard = shard
        self.namespace = namespace
        self.metadata = metadata
        self.sync = sync
        self._owns_metadata = owns_metadata
        # set by the process that wires the store into a cluster: puts with replicas > 1
        self.replica_writer: ReplicaWriter | None = None

    def client(self, namespace: Namespace | None = None) -> EmbeddedClient:
        """An EmbeddedClient for ``namespace`` (default: the one the store was opened with).
        Raises NamespaceMismatchError if it is not of the shard's model."""
        ns = namespace or self.namespace
        if ns is None:
            raise ValueError("namespace: the store was opened with a fingerprint; pass one")
        return EmbeddedClient(self.shard, ns, self.metadata, writer=self.replica_writer)

    def flush_metadata(self) -> int:
        """Write pending block events to the metadata now (one Raft entry)."""
        return 0 if self.sync is None else self.sync.flush()

    def close(self) -> None:
        self.shard.close()
        if self.sync is not None:
            self.sync.close()
        if self.metadata is not None and self._owns_metadata:
            self.metadata.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(
    config: StoreConfig,
    namespace: Namespace | str,
    node_id: NodeId = LOCAL_NODE,
    metadata: MetadataGroup | MetadataConfig | None = None,
) -> Store:
    """Open one node's store.

    ``namespace``: a Namespace (its fingerprint binds the shard; its dtype sets the shuffle
    width when ``config.shuffle_bytes`` is None) or a fingerprint string. ``metadata``: None
    (no metadata), a started MetadataGroup (shared; not closed by the store), or a
    MetadataConfig (the store creates, starts and owns a group; e.g. a single replica with its
    journal under the data directory). With metadata, the shard's holdings are re-adopted into
    it at open and events are flushed in batches by a background MetadataSync, and eviction
    reads replica counts from the group's view.
    """
    ns = namespace if isinstance(namespace, Namespace) else None
    fingerprint = ns.fingerprint() if ns is not None else str(namespace)
    shuffle = config.shuffle_bytes or (ns.layout.itemsize if ns is not None else 1)
    group: MetadataGroup | None = None
    owns = False
    if isinstance(metadata, MetadataConfig):
        group, owns = MetadataGroup(metadata), True
        group.start()
    elif metadata is not None:
        group = metadata
    try:
        if group is not None:
            group.wait_ready(METADATA_READY_TIMEOUT_S)
        replicas: ReplicaCounter = (
            MetadataReplicas(group.view(), node_id) if group is not None else LocalReplicas()
        )
        shard = Shard(config, fingerprint, node_id, replicas, shuffle_bytes=shuffle)
    except BaseException:
        if owns and group is not None:
            group.close()
        raise
    sync: MetadataSync | None = None
    if group is not None:
        sync = MetadataSync(shard, group, node_id, config.metadata_flush_interval_s)
        try:
            sync.readopt()
        except BaseException:
            shard.close()
            if owns:
                group.close()
            raise
        sync.start()
    return Store(shard, ns, group, sync, owns)


def single_replica_metadata(config: StoreConfig, port: int) -> MetadataConfig:
    """A one-replica metadata group on 127.0.0.1:``port`` with its journal in
    ``data_dir/meta`` (in memory without a data_dir)."""
    journal = None if config.data_dir is None else config.data_dir / "meta"
    return MetadataConfig(self_address=f"127.0.0.1:{port}", journal_dir=journal)


__all__ = ["Store", "open_store", "single_replica_metadata"]
