"""The metadata service's wire format: metadata.proto loaded at run time, and the conversions
between its messages and the group's Python values (shared by ``service.py`` and ``remote.py``).

Keys travel packed (``codec.pack_keys``), tiers as one byte each, holders flattened; so a
batch of thousands of blocks is a few ``bytes`` fields, not one message per block.
Functions here are pure and thread-safe; decoders validate and raise ``ValueError`` naming
the field (the service maps it to INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.grpc_proto import load_proto
from kvflow.replication.codec import MAX_KEY_BYTES, pack_keys, unpack_keys
from kvflow.replication.types import TIERS_BY_VALUE, NodeId, NodeInfo, Tier

pb2, pb2_grpc = load_proto("kvflow/replication/metadata.proto")
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name

LEADER_METADATA_KEY = "kvflow-leader"
"""Trailing metadata of an UNAVAILABLE reply: the leader's Raft address, when known."""

MAX_MESSAGE_BYTES = 256 << 20
"""gRPC message limit on both ends: a ``replace_holdings`` of a big node is one message."""

GRPC_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def keys_msg(keys: Sequence[bytes]) -> Any:
    """Pack validated keys into a ``Keys`` message."""
    width, blob = pack_keys(keys)
    return pb2.Keys(width=width, blob=blob)


def keys_from(msg: Any, field: str) -> list[bytes]:
    """Unpack a ``Keys`` message; raise ``ValueError`` naming ``field`` if malformed."""
    if msg.width > MAX_KEY_BYTES:
        raise ValueError(f"{field}: key width {msg.width} exceeds {MAX_KEY_BYTES} bytes")
    try:
        keys = unpack_keys(msg.width, msg.blob)
    except (ValueError, IndexError) as exc:
        raise ValueError(f"{field}: malformed packed keys: {exc}") from exc
    for i, key in enumerate(keys):
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"{field}[{i}]: key length must be 1..{MAX_KEY_BYTES}")
    return keys


def tier_bytes(tiers: Sequence[Tier]) -> bytes:
    return bytes(tier.value for tier in tiers)


def stored_from(keys: list[bytes], tiers: bytes, field: str) -> list[tuple[bytes, Tier]]:
    """Pair keys with their tier bytes; raise ``ValueError`` naming ``field`` on a mismatch."""
    if len(tiers) != len(keys):
        raise ValueError(f"{field}: {len(tiers)} tier bytes for {len(keys)} keys")
    try:
        return [(key, TIERS_BY_VALUE[t]) for key, t in zip(keys, tiers, strict=True)]
    except IndexError:
        bad = next(t for t in tiers if t >= len(TIERS_BY_VALUE))
        raise ValueError(f"{field}: unknown tier value {bad}") from None


def holders_msg(holders: Sequence[dict[NodeId, Tier]]) -> Any:
    """Flatten per-key holders into a ``HoldersReply``."""
    index: dict[str, int] = {}
    counts: list[int] = []
    node_index: list[int] = []
    tiers = bytearray()
    for replicas in holders:
        counts.append(len(replicas))
        for node, tier in replicas.items():
            node_index.append(index.setdefault(node, len(index)))
            tiers.append(tier.value)
    return pb2.HoldersReply(
        nodes=list(index), counts=counts, node_index=node_index, tiers=bytes(tiers)
    )


def holders_from(reply: Any) -> list[dict[NodeId, Tier]]:
    """Inverse of :func:`holders_msg` (new dicts the caller owns)."""
    nodes = [NodeId(node) for node in reply.nodes]
    node_index = reply.node_index
    tiers = reply.tiers
    out: list[dict[NodeId, Tier]] = []
    pos = 0
    for count in reply.counts:
        out.append(
            {nodes[node_index[i]]: TIERS_BY_VALUE[tiers[i]] for i in range(pos, pos + count)}
        )
        pos += count
    return out


def node_info_msg(info: NodeInfo) -> Any:
    return pb2.NodeInfo(
        node=info.node,
        address=info.address,
        kind=info.kind,
        registered_at=info.registered_at,
        last_heartbeat=info.last_heartbeat,
        num_blocks=info.num_blocks,
    )


def node_info_from(msg: Any) -> NodeInfo:
    return NodeInfo(
        node=NodeId(msg.node),
        address=msg.address,
        kind=msg.kind,
        registered_at=msg.registered_at,
        last_heartbeat=msg.last_heartbeat,
        num_blocks=msg.num_blocks,
    )
