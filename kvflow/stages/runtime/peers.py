"""Other nodes of the store, seen from one node: who holds what (from the metadata group) and
how to read it (kvdb RemoteClient over the transfer engine).

A node registers in the metadata as ``<grpc host:port>|<transfer host:port>``. Each peer's
circuit breaker comes from the process's ``PeerBreakers``, keyed by the peer's transfer
address, so its block reads and the KV stream into it (a decode node) share one breaker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.kvdb import Namespace, PeerBreakers, RemoteClient, RemoteClientConfig
from kvflow.replication import NodeId
from kvflow.transfer import TransferEngine

PEERS_TTL_S = 0.5


def format_node_address(control: str, transfer: str) -> str:
    return f"{control}|{transfer}"


def parse_node_address(address: str) -> tuple[str, str] | None:
    """(control, transfer) of a registered node address, or None for another format."""
    control, sep, transfer = address.partition("|")
    return (control, transfer) if sep and control and transfer else None


@dataclass
class RemotePeer:
    """One other node: its blocks (per the metadata) and a reader of them."""

    node_id: str
    control: str
    transfer_peer: str
    view: Any  # RemoteMetadataView: holders(keys)
    transfer: TransferEngine
    kind: str = ""  # "prefill" | "decode", as registered
    breakers: PeerBreakers | None = None  # the process's; None: the reader's own breaker
    _reader: RemoteClient | None = None

    def match_prefix(self, keys: list[bytes]) -> int:
        """Leading keys this node holds, per the metadata (may lag by its cache TTL)."""
        if not keys:
            return 0
        holders = self.view.holders(keys)
        n = 0
        for h in holders:
            if NodeId(self.node_id) not in h:
                break
            n += 1
        return n

    def client(self, namespace: Namespace) -> RemoteClient:
        """A reader of this node's DRAM blocks (namespaces are in the keys already)."""
        if self._reader is None:
            breakers = self.breakers
            self._reader = RemoteClient(
                self.control,
                self.transfer,
                self.transfer_peer,
                shard=self.node_id,
                config=None if breakers is None else RemoteClientConfig(budget=breakers.budget),
                breaker=None if breakers is None else breakers.get(self.transfer_peer),
            )
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


class RemotePeers(Mapping[str, RemotePeer]):
    """The other nodes that hold blocks, refreshed from the metadata at most every
    ``PEERS_TTL_S`` seconds. ``breakers``: the process's per-peer breakers and budget (module
    doc); default: a new one. Thread-safe."""

    def __init__(
        self,
        self_id: str,
        metadata: Any,
        transfer: TransferEngine,
        breakers: PeerBreakers | None = None,
    ) -> None:
        self.breakers = breakers or PeerBreakers()
        self._self_id = self_id
        self._metadata = metadata
        self._transfer = transfer
        self._peers: dict[str, RemotePeer] = {}
        self._loaded = 0.0
        self._lock = threading.Lock()

    def _current(self) -> dict[str, RemotePeer]:
        with self._lock:
            if time.monotonic() - self._loaded < PEERS_TTL_S:
                return self._peers
            view = self._metadata.view()
            peers: dict[str, RemotePeer] = {}
            for info in view.nodes():
                addresses = parse_node_address(info.address)
                if info.node == self._self_id or addresses is None:
                    continue
                old = self._peers.get(info.node)
                if old is not None and (old.control, old.transfer_peer, old.kind) == (
                    *addresses,
                    info.kind,
                ):
                    peers[info.node] = old
                else:
                    peers[info.node] = RemotePeer(
                        info.node,
                        addresses[0],
                        addresses[1],
                        view,
                        self._transfer,
                        info.kind,
                        self.breakers,
                    )
            self._peers, self._loaded = peers, time.monotonic()
            return peers

    def __getitem__(self, key: str) -> RemotePeer:
        return self._current()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._current()))

    def __len__(self) -> int:
        return len(self._current())

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers = {}
