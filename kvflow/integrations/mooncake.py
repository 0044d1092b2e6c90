"""A Mooncake Store-compatible Python API over kvdb: switch the import, keep the calls.

``from kvflow.integrations.mooncake import MooncakeDistributedStore, ReplicateConfig`` in
place of ``from mooncake.store import ...``. Methods, arguments and return conventions follow
Mooncake's Python API page (0 / byte counts on success, negative codes on error, 1/0/-1 for
existence, empty bytes for a missing get). ``metadata_server`` names kvflow's metadata
replicas ("host:port,host:port,...") or "embedded" for a store in this process only; the
differences are listed in README.md in this folder.

Thread-safe (the member is). Buffers passed by address must be registered first
(``register_buffer``); an unregistered address is refused with INVALID_PARAMS.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import re
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.integrations.config import MemberConfig
from kvflow.integrations.member import ClusterMember
from kvflow.kvdb import KVDBError, KVLayout, Namespace, NotEnoughReplicasError
from kvflow.kvdb.keys import named_key

logger = logging.getLogger(__name__)

# Mooncake's ErrorCode values for the cases this API reports.
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200  # fewer members than replica_num can hold a copy
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705

_LAYOUT = KVLayout(1, 1, 1, 1, "uint8")  # values are opaque bytes of any size


@dataclass
class ReplicateConfig:
    """Mooncake's replication config; kvflow reads ``replica_num`` (the block's replica
    target in the metadata). ``preferred_segments`` is accepted and ignored."""

    replica_num: int = 1
    with_soft_pin: bool = False
    preferred_segment: str = ""


class MooncakeDistributedStore:
    """See the module doc. Construct, then ``setup(...)``; ``close()`` at the end."""

    def __init__(self) -> None:
        self._member: ClusterMember | None = None
        self._ns: Namespace | None = None
        self._names: dict[str, bytes] = {}  # keys put through this object (for regex/all)
        self._sizes: dict[bytes, int] = {}  # value sizes of keys put here: hints for reads
        # Registered buffers, sorted by address, as (starts, (start, end, view) per buffer):
        # replaced whole under the lock, read without it.
        self._regions: tuple[list[int], list[tuple[int, int, np.ndarray]]] = ([], [])
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- setup

    def setup(
        self,
        local_hostname: str | Mapping[str, Any],
        metadata_server: str = "embedded",
        global_segment_size: int = 16777216,
        local_buffer_size: int = 1073741824,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "",
    ) -> int:
        """Join (or, with "embedded", open) a store. A mapping as the first argument is a
        config dict with the same names (``master_server_address`` also accepted) plus any
        ``kvflow_*`` MemberConfig keys. Returns 0, or INVALID_PARAMS / INTERNAL_ERROR."""
        if isinstance(local_hostname, Mapping):
            cfg = dict(local_hostname)
        else:
            cfg = {
                "local_hostname": local_hostname,
                "metadata_server": metadata_server,
                "global_segment_size": global_segment_size,
                "protocol": protocol,
            }
        if self._member is not None or cfg.get("protocol", "tcp") != "tcp":
            logger.error("setup: already set up, or a protocol other than tcp")
            return INVALID_PARAMS
        meta = str(cfg.get("metadata_server", "embedded"))
        host = str(cfg.get("local_hostname", "127.0.0.1")).rpartition(":")
        defaults: dict[str, Any] = {
            "node_id": f"mooncake-{uuid.uuid4().hex[:12]}",
            "host": host[0] or host[2] or "127.0.0.1",
            "dram_bytes": int(cfg.get("global_segment_size", 16777216)),
            "engine": "memory",
            "meta": () if meta in ("", "embedded") else meta,
        }
        try:
            config = MemberConfig.from_mapping(cfg, **defaults)
            self._ns = Namespace(config.tenant, "mooncake-store", _LAYOUT)
            self._member = ClusterMember(config, self._ns)
        except (ValueError, TypeError) as exc:
            logger.error("setup: %s", exc)
            return INVALID_PARAMS
        except Exception:
            logger.exception("setup failed")
            return INTERNAL_ERROR
        return 0

    def close(self) -> int:
        if self._member is not None:
            self._member.close()
            self._member = None
        return 0

    def _ready(self) -> tuple[ClusterMember, Namespace]:
        if self._member is None or self._ns is None:
            raise RuntimeError("setup() first")
        return self._member, self._ns

    def _key(self, key: Any) -> bytes | None:
        if not isinstance(key, str) or not key:
            return None
        known = self._names.get(key)
        return known if known is not None else named_key(self._ready()[1], key.encode("utf-8"))

    # ----------------------------------------------------------------- buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow ``[buffer_ptr, buffer_ptr + size)`` in the zero-copy calls (and as a direct
        destination of remote reads). 0, or INVALID_PARAMS."""
        member, _ = self._ready()
        if (
            not isinstance(buffer_ptr, int)
            or buffer_ptr <= 0
            or not isinstance(size, int)
            or size <= 0
        ):
            return INVALID_PARAMS
        view = self._view(buffer_ptr, size)
        with self._lock:
            regions = [r for r in self._regions[1] if r[0] != buffer_ptr]
            regions.append((buffer_ptr, buffer_ptr + size, view))
            regions.sort(key=lambda r: r[0])
            self._regions = ([r[0] for r in regions], regions)
        member.register_destination(view)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            regions = [r for r in self._regions[1] if r[0] != buffer_ptr]
            if len(regions) == len(self._regions[1]):
                return INVALID_PARAMS
            self._regions = ([r[0] for r in regions], regions)
        return 0

    def _view(self, ptr: int, size: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))

    def _registered_view(self, ptr: Any, size: Any) -> np.ndarray | None:
        """A view of ``[ptr, ptr + size)`` if it lies inside one registered buffer."""
        if not isinstance(ptr, int) or not isinstance(size, int) or size <= 0:
            return None
        starts, regions = self._regions
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr + size <= regions[i][1]:
            start, _, view = regions[i]
            return view[ptr - start : ptr - start + size]
        for start, end, view in regions[: max(i, 0)]:  # overlapping registrations
            if start <= ptr and ptr + size <= end:
                return view[ptr - start : ptr - start + size]
        return None

    # ----------------------------------------------------------------- writes

    def put(self, key: str, value: bytes, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (copied). 0; OBJECT_ALREADY_EXISTS if ``key`` is held here
        (objects are immutable); INVALID_PARAMS for a bad key or an empty value;
        INTERNAL_ERROR when no tier has room."""
        member, _ = self._ready()
        bkey = self._key(key)
        try:
            data = memoryview(value)
        except TypeError:
            return INVALID_PARAMS
        if bkey is None or data.nbytes == 0:
            return INVALID_PARAMS
        if member.store.shard.exists(bkey):
            return OBJECT_ALREADY_EXISTS
        try:  # acknowledged only once replica_num members hold it (docs/durability.md)
            ok = member.put(bkey, data, replicas=1 if config is None else config.replica_num)
        except NotEnoughReplicasError as exc:
            logger.warning("put key=%s: %s", key, exc)
            return NO_AVAILABLE_HANDLE
        except KVDBError as exc:
            logger.warning("put key=%s: %s", key, exc)
            return INVALID_PARAMS
        if not ok:
            return INTERNAL_ERROR
        with self._lock:
            self._names[key] = bkey
            self._sizes[bkey] = data.nbytes
        return 0

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        view = self._registered_view(buffer_ptr, size)
        return INVALID_PARAMS if view is None else self.put(key, view, config)

    def put_batch(
        self, keys: Sequence[str], values: Sequence[bytes], config: ReplicateConfig | None = None
    ) -> int:
        """0 if every put succeeded, else the first error code."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        codes = [self.put(k, v, config) for k, v in zip(keys, values, strict=True)]
        return next((c for c in codes if c != 0), 0)

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return [
            self.put_from(k, p, s, config) for k, p, s in zip(keys, buffer_ptrs, sizes, strict=True)
        ]

    # ----------------------------------------------------------------- reads

    def get_size(self, key: str) -> int:
        """The object's size, OBJECT_NOT_FOUND, or INVALID_PARAMS."""
        member, _ = self._ready()
        bkey = self._key(key)
        if bkey is None:
            return INVALID_PARAMS
        known = self._sizes.get(bkey)
        if known is not None and member.store.shard.exists(bkey):
            return known
        size = member.size_of(bkey)
        return OBJECT_NOT_FOUND if size is None else size

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into the registered buffer, or OBJECT_NOT_FOUND, BUFFER_OVERFLOW
        (buffer smaller than the object), INVALID_PARAMS (bad key or unregistered buffer)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``get_into`` per key, as one batch: this shard's objects are copied, the rest read
        from the members holding them with one lease and one transfer batch per member."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        member, _ = self._ready()
        out = [INVALID_PARAMS] * len(keys)
        idx: list[int] = []
        bkeys: list[bytes] = []
        views: list[np.ndarray] = []
        hints = self._sizes
        for i, (key, ptr, size) in enumerate(zip(keys, buffer_ptrs, sizes, strict=True)):
            bkey = self._key(key)
            view = self._registered_view(ptr, size)
            if bkey is not None and view is not None:
                idx.append(i)
                bkeys.append(bkey)
                views.append(view)
        if not idx:
            return out
        got = member.read_fitting(bkeys, views, [hints.get(k) for k in bkeys])
        for i, bkey, fetched in zip(idx, bkeys, got, strict=True):
            if fetched.source is not None:
                out[i] = fetched.nbytes
                if fetched.source != "remote":
                    hints[bkey] = fetched.nbytes
            else:
                out[i] = BUFFER_OVERFLOW if fetched.too_small else OBJECT_NOT_FOUND
        return out

    def get(self, key: str) -> bytes:
        """The object's bytes, or b"" if it is missing (or the key is bad)."""
        member, _ = self._ready()
        bkey = self._key(key)
        if bkey is None:
            return b""
        nbytes = self._sizes.get(bkey)
        for _ in range(2):  # a second time if the size hint was stale
            if nbytes is None:
                nbytes = member.size_of(bkey)
            if nbytes is None:
                return b""
            out = bytearray(nbytes)
            fetched = member.read_fitting([bkey], [np.frombuffer(out, np.uint8)], [nbytes])[0]
            if not fetched.too_small:
                return bytes(out[: fetched.nbytes]) if fetched.source is not None else b""
            nbytes = fetched.nbytes
        return b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def is_exist(self, key: str) -> int:
        """1 held (here or by a live member), 0 not, -1 bad key."""
        member, _ = self._ready()
        bkey = self._key(key)
        return -1 if bkey is None else int(member.present([bkey])[0])

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return [self.is_exist(k) for k in keys]

    # ----------------------------------------------------------------- removal

    def remove(self, key: str) -> int:
        """0 removed from this process's shard, OBJECT_NOT_FOUND, INVALID_PARAMS."""
        member, _ = self._ready()
        bkey = self._key(key)
        if bkey is None:
            return INVALID_PARAMS
        with self._lock:
            self._names.pop(key, None)
            self._sizes.pop(bkey, None)
        return 0 if member.remove([bkey]) == 1 else OBJECT_NOT_FOUND

    def remove_by_regex(self, regex: str) -> int:
        """How many keys put through this object that match ``regex`` (``re.search``) were
        removed; INVALID_PARAMS for a bad pattern."""
        try:
            pattern = re.compile(regex)
        except (re.error, TypeError):
            return INVALID_PARAMS
        with self._lock:
            names = [n for n in self._names if pattern.search(n)]
        return sum(self.remove(n) == 0 for n in names)

    def remove_all(self) -> int:
        """Remove every object this process's shard holds; how many."""
        member, _ = self._ready()
        with self._lock:
            self._names.clear()
            self._sizes.clear()
        return member.remove_all()


__all__ = [
    "BUFFER_OVERFLOW",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_NOT_FOUND",
    "MooncakeDistributedStore",
    "ReplicateConfig",
]
