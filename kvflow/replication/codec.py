"""Compact command payloads: many keys and tiers in a few ``bytes`` objects.

A batch of block keys travels in a Raft entry as ``(width, blob)``: when every key has the
same length (the usual case: kvdb keys are 16-byte digests) ``width`` is that length and
``blob`` is the concatenation; otherwise ``width`` is 0 and each key is prefixed by its
length as 2 little-endian bytes. Tiers travel as one byte per key. This keeps the journal
and the wire free of per-block Python objects (pickle memoizes every ``bytes`` it sees).

Functions here are pure and thread-safe; they never keep references to their inputs.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

from kvflow.replication.types import Tier

MAX_KEY_BYTES = 1024
"""Longest accepted block key. Keys are opaque, but a key is a digest, not a value."""

_LEN = struct.Struct("<H")


def check_node(node: object) -> str:
    """Return ``node`` if it is a non-empty ``str`` (a ``NodeId``); raise otherwise."""
    if not isinstance(node, str) or not node:
        raise ValueError(f"node: expected a non-empty str NodeId, got {node!r}")
    return node


def check_now(now: object) -> float:
    """Return ``now`` as a float if it is a finite number of seconds; raise otherwise."""
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ValueError(f"now: expected a finite number of seconds, got {now!r}")
    return float(now)


def check_key(key: object, field: str = "key") -> bytes:
    """Return ``key`` if it is a non-empty ``bytes`` of at most MAX_KEY_BYTES; raise otherwise."""
    if not isinstance(key, bytes):
        raise TypeError(f"{field}: expected bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"{field}: length must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def split_stored(stored: Sequence[tuple[bytes, Tier]]) -> tuple[list[bytes], bytes]:
    """Validate ``(key, Tier)`` pairs and split them into a key list and a tier byte string.

    Raises ``TypeError``/``ValueError`` naming the offending position; nothing is kept.
    """
    keys: list[bytes] = []
    tiers = bytearray()
    for i, pair in enumerate(stored):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"stored[{i}]: expected a (bytes, Tier) pair, got {pair!r}")
        key, tier = pair
        if not isinstance(tier, Tier):
            raise TypeError(f"stored[{i}]: tier must be a Tier, got {tier!r}")
        keys.append(check_key(key, f"stored[{i}] key"))
        tiers.append(tier.value)
    return keys, bytes(tiers)


def check_keys(keys: Sequence[bytes], field: str) -> list[bytes]:
    """Validate a sequence of keys; return them as a new list."""
    if isinstance(keys, bytes | str):
        raise TypeError(f"{field}: expected a sequence of bytes keys, not a single {type(keys)}")
    return [check_key(key, f"{field}[{i}]") for i, key in enumerate(keys)]


def pack_keys(keys: Sequence[bytes]) -> tuple[int, bytes]:
    """Pack validated keys into ``(width, blob)`` (see the module docstring)."""
    if not keys:
        return 0, b""
    width = len(keys[0])
    if all(len(key) == width for key in keys):
        return width, b"".join(keys)
    parts: list[bytes] = []
    for key in keys:
        parts.append(_LEN.pack(len(key)))
        parts.append(key)
    return 0, b"".join(parts)


def unpack_keys(width: int, blob: bytes) -> list[bytes]:
    """Inverse of :func:`pack_keys`. Raises ``ValueError`` on a malformed blob."""
    if width > 0:
        if len(blob) % width:
            raise ValueError(f"blob: {len(blob)} bytes is not a multiple of width {width}")
        return [blob[i : i + width] for i in range(0, len(blob), width)]
    keys: list[bytes] = []
    pos = 0
    while pos < len(blob):
        if pos + _LEN.size > len(blob):
            raise ValueError("blob: truncated variable-width key length")
        (size,) = _LEN.unpack_from(blob, pos)
        end = pos + 2 + size
        if end > len(blob):
            raise ValueError("blob: truncated variable-width key")
        keys.append(blob[pos + 2 : end])
        pos = end
    return keys


def chunk_bounds(keys: Sequence[bytes], max_bytes: int) -> list[tuple[int, int]]:
    """Split ``keys`` into consecutive ``[start, end)`` runs of at most ``max_bytes`` key bytes.

    Every run holds at least one key. An empty input gives one empty run ``[(0, 0)]`` so a
    caller that must emit at least one entry (``replace_holdings``) can.
    """
    bounds: list[tuple[int, int]] = []
    start = 0
    size = 0
    for i, key in enumerate(keys):
        cost = len(key) + 2
        if i > start and size + cost > max_bytes:
            bounds.append((start, i))
            start, size = i, 0
        size += cost
    bounds.append((start, len(keys)))
    return bounds
