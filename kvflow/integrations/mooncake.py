"""A Mooncake Store-compatible Python API over kvdb: switch the import, keep the calls.

``from kvflow.integrations.mooncake import MooncakeDistributedStore, ReplicateConfig`` in
place of ``from mooncake.store import ...``. Every public name of ``mooncake.store``
(mooncake-transfer-engine 0.3.13.post1) that a CPU build can serve is here with Mooncake's
arguments, defaults and return codes, checked against the real wheel by
tests/integrations/test_mooncake_differential.py. ``metadata_server`` names kvflow's metadata
replicas ("host:port,host:port,...") or "embedded" (a store in this process only); a
Mooncake URL (``http://...``, ``etcd://...``, ``P2PHANDSHAKE``) runs embedded unless the
config dict has ``kvflow_meta``. Differences: docs/mooncake-store.md.

Thread-safe (the member is; the name, size and lease tables have their locks).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvflow.integrations import mooncake_tensors as tensors
from kvflow.integrations.config import MemberConfig
from kvflow.integrations.member import ClusterMember, Misses
from kvflow.integrations.mooncake_buffers import BufferHandle, Regions, view_at
from kvflow.integrations.mooncake_leases import Leases
from kvflow.integrations.mooncake_setup import SetupArgs, from_dict, parse_size
from kvflow.integrations.mooncake_types import (
    ErrorCode,
    ObjectDataType,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    soft_pin_ms,
)
from kvflow.integrations.peers import parse_member_address
from kvflow.kvdb import KVDBError, KVLayout, Namespace, NotEnoughReplicasError
from kvflow.kvdb.keys import NamedKeys, named_key_prefix

logger = logging.getLogger(__name__)

INTERNAL_ERROR = int(ErrorCode.INTERNAL_ERROR)
BUFFER_OVERFLOW = int(ErrorCode.BUFFER_OVERFLOW)
NO_AVAILABLE_HANDLE = int(ErrorCode.NO_AVAILABLE_HANDLE)
INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
OBJECT_NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
OBJECT_ALREADY_EXISTS = int(ErrorCode.OBJECT_ALREADY_EXISTS)
OBJECT_HAS_LEASE = int(ErrorCode.OBJECT_HAS_LEASE)
TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)
NOT_SUPPORTED = int(ErrorCode.NOT_SUPPORTED)

DERIVED_KEYS = 1 << 16
"""Keys derived from names read (not written) through a store, kept for the next read."""
_LAYOUT = KVLayout(1, 1, 1, 1, "uint8")  # values are opaque bytes of any size
_DEFAULT = ReplicateConfig()
_EMBEDDED = ("", "embedded")
META_ENV = "KVFLOW_MOONCAKE_META"  # kvflow metadata addresses for Mooncake-URL setups


def _mooncake_url(server: str) -> bool:
    return "://" in server or server.upper() == "P2PHANDSHAKE"


class MooncakeDistributedStore:
    """See the module doc. Construct, then ``setup(...)``; ``close()`` at the end. Calls
    before ``setup`` (or after ``close``) raise RuntimeError (Mooncake's crash the process)."""

    def __init__(self) -> None:
        self._member: ClusterMember | None = None
        self._ns: Namespace | None = None
        self._named: NamedKeys | None = None
        self._args: SetupArgs | None = None
        self._names: dict[str, bytes] = {}  # objects written through this store (regex/all)
        self._derived: dict[str, bytes] = {}  # other names' keys, as read (a bounded cache)
        self._sizes: dict[bytes, int] = {}  # their sizes: hints for reads
        self._regions = Regions()
        self._leases = Leases(0)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- setup

    def setup(
        self,
        local_hostname: str | Mapping[str, Any],
        metadata_server: str = "embedded",
        global_segment_size: int | str = 16 << 20,
        local_buffer_size: int | str = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Join (or open, embedded) a store: positional as Mooncake's, or one config dict
        (Mooncake's keys, sizes as ints or "16MB"-style strings, plus ``kvflow_*`` member
        options and ``kvflow_kv_lease_ttl``). 0; INVALID_PARAMS for a bad argument;
        INTERNAL_ERROR if already set up, for a protocol other than tcp, or a failed join."""
        if isinstance(local_hostname, Mapping):
            parsed = from_dict(local_hostname)
        else:
            sizes = [parse_size(global_segment_size), parse_size(local_buffer_size)]
            if None in sizes:
                parsed = f"not a size: {global_segment_size!r} / {local_buffer_size!r}"
            else:
                parsed = SetupArgs(
                    str(local_hostname), str(metadata_server), sizes[0] or 0, sizes[1] or 0,
                    str(protocol), str(tenant_id),
                )  # fmt: skip
        if isinstance(parsed, str):
            logger.error("setup: %s", parsed)
            return INVALID_PARAMS
        if self._member is not None or parsed.protocol != "tcp":
            logger.error("setup: already set up, or protocol %r (only tcp)", parsed.protocol)
            return INTERNAL_ERROR
        return self._join(parsed)

    def _join(self, args: SetupArgs) -> int:
        meta: Any = "" if args.metadata_server in _EMBEDDED else args.metadata_server
        if _mooncake_url(args.metadata_server):
            meta = os.environ.get(META_ENV, "")
            logger.info("setup: Mooncake metadata %r: kvflow meta %r", args.metadata_server, meta)
        host = args.local_hostname.rpartition(":")
        bind = os.environ.get("MC_TCP_BIND_ADDRESS") or host[0] or host[2] or "127.0.0.1"
        defaults: dict[str, Any] = {
            "node_id": f"mooncake-{uuid.uuid4().hex[:12]}",
            "host": bind,
            "dram_bytes": max(args.global_segment_size, 1 << 20),
            "engine": "memory",
            "meta": meta,
            # The segment is memory given to the store at setup (as Mooncake registers its
            # segment then): its pages are faulted in now, not on the put path.
            "dram_prefault": True,
            # Integrity is checked where bytes can go bad: SSD records and reads from peers.
            # A hit in this process's own DRAM pool (peers can only read it) is one copy, as
            # Mooncake's local read is.
            "verify_dram_hits": False,
        }
        if args.tenant_id != "default":
            defaults["tenant"] = args.tenant_id
        try:
            config = MemberConfig.from_mapping(args.kvflow, **defaults)
            self._ns = Namespace(config.tenant, "mooncake-store", _LAYOUT)
            self._named = named_key_prefix(self._ns)
            self._derived.clear()
            # b"" tells a Mooncake client the object is gone: a holder that is only slow
            # gets a last-resort try before a get answers that (Misses.ANSWER)
            self._member = ClusterMember(config, self._ns, misses=Misses.ANSWER)
        except (ValueError, TypeError) as exc:
            logger.error("setup: %s", exc)
            return INVALID_PARAMS
        except Exception:
            logger.exception("setup failed")
            return INTERNAL_ERROR
        self._args = args
        self._leases = Leases(args.lease_ttl_ms)
        return 0

    def close(self) -> int:
        """Leave the store; this process's objects go with it (as Mooncake's segment). 0."""
        member, self._member = self._member, None
        if member is not None:
            member.close()
        with self._lock:
            self._names.clear()
            self._derived.clear()
            self._sizes.clear()
        self._leases.clear()
        self._regions.clear()
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed."""
        return 0 if self._member is not None else 1

    def get_hostname(self) -> str:
        """``host:port`` of this client: the transfer server's port in a cluster, 0 when
        embedded (nothing listens)."""
        member, _ = self._ready()
        assert self._args is not None
        host = self._args.local_hostname.rpartition(":")
        parsed = parse_member_address(member.address)
        port = parsed[1].rpartition(":")[2] if parsed else "0"
        return f"{host[0] or host[2]}:{port}"

    def _ready(self) -> tuple[ClusterMember, Namespace]:
        if self._member is None or self._ns is None:
            raise RuntimeError("MooncakeDistributedStore: setup() first (or it was closed)")
        return self._member, self._ns

    def _key(self, name: Any) -> bytes | None:
        if not isinstance(name, str) or not name:
            return None
        known = self._names.get(name) or self._derived.get(name)
        if known is not None:
            return known
        self._ready()
        assert self._named is not None
        key = self._named.key(name.encode("utf-8"))
        if len(self._derived) >= DERIVED_KEYS:
            self._derived.clear()
        self._derived[name] = key
        return key

    # ----------------------------------------------------------------- buffers

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``[buffer_ptr, buffer_ptr + size)`` (a remote read lands there directly).
        0; INVALID_PARAMS for a null pointer, a size of 0 or a start registered already."""
        member, _ = self._ready()
        if buffer_ptr <= 0 or size <= 0:
            return INVALID_PARAMS
        view = self._regions.add(buffer_ptr, size)
        if view is None:
            return INVALID_PARAMS
        member.register_destination(view)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return 0 if self._regions.drop(buffer_ptr) else INVALID_PARAMS

    def _dest(self, ptr: int, size: int) -> np.ndarray | None:
        """Where a read into ``ptr`` goes: the registered view, or (as Mooncake over tcp) the
        caller's memory as is; None for a null pointer or a size <= 0."""
        if ptr <= 0 or size <= 0:
            return None
        view = self._regions.find(ptr, size)
        return view if view is not None else view_at(ptr, size)

    # ----------------------------------------------------------------- writes

    def _write(
        self, key: str, value: Any, config: ReplicateConfig | None, upsert: bool, staged: bool
    ) -> int:
        """One put/upsert (see ``_write_all``)."""
        return self._write_all([(key, value)], config, upsert, staged)[0]

    def _write_all(
        self, items: Sequence[tuple[str, Any]], config: ReplicateConfig | None, upsert: bool,
        staged: bool,
    ) -> list[int]:  # fmt: skip
        """Puts/upserts in order, a code per item. ``staged``: the values pass through the
        local buffer (Mooncake refuses a value larger than ``local_buffer_size`` there).
        Which keys exist already is asked once for the batch (one metadata lookup for the
        keys this shard lacks, not one per key)."""
        member, _ = self._ready()
        config = config if config is not None else _DEFAULT
        soft = soft_pin_ms(config)
        assert self._args is not None
        limit = self._args.local_buffer_size if staged else None
        out = [INVALID_PARAMS] * len(items)
        todo: list[tuple[int, str, bytes, memoryview]] = []
        for i, (key, value) in enumerate(items):
            data = memoryview(value).cast("B")  # TypeError for a non-buffer, as Mooncake
            bkey = self._key(key)
            if bkey is None or data.nbytes == 0 or isinstance(soft, ErrorCode):
                continue
            if limit is not None and data.nbytes > limit:
                continue
            todo.append((i, key, bkey, data))
        held = member.present([t[2] for t in todo]) if todo else []
        written: set[bytes] = set()
        for (i, key, bkey, data), present in zip(todo, held, strict=True):
            if present or bkey in written:
                if not upsert:
                    out[i] = 0  # Mooncake: a put of a key that exists changes nothing
                    continue
                if member.store.shard.exists(bkey):
                    old = self._sizes.get(bkey) or member.size_of(bkey)
                    if member.remove([bkey]) != 1:
                        out[i] = OBJECT_HAS_LEASE  # a peer is reading it this instant
                        continue
                    if old != data.nbytes:
                        # Mooncake updates a same-size object in place (its lease stays) and
                        # replaces one of another size with a new, unleased object.
                        self._leases.release(key)
            out[i] = self._put_one(member, key, bkey, data, config, soft)
            if out[i] == 0:
                written.add(bkey)
        return out

    def _put_one(
        self, member: ClusterMember, key: str, bkey: bytes, data: memoryview,
        config: ReplicateConfig, soft: int | None,
    ) -> int:  # fmt: skip
        try:  # acknowledged only once replica_num members hold it (docs/durability.md)
            ok = member.put(bkey, data, replicas=config.replica_num)
        except NotEnoughReplicasError as exc:
            logger.warning("put key=%s: %s", key, exc)
            return NO_AVAILABLE_HANDLE
        except KVDBError as exc:
            logger.warning("put key=%s: %s", key, exc)
            return INVALID_PARAMS
        if not ok:
            return NO_AVAILABLE_HANDLE
        with self._lock:
            self._names[key] = bkey
            self._sizes[bkey] = data.nbytes
        self._leases.pin(key, soft, bool(config.with_hard_pin))
        return 0

    def put(self, key: str, value: Any, config: ReplicateConfig = _DEFAULT) -> int:
        """Store ``value`` (copied). 0, also when ``key`` exists (then nothing changes);
        INVALID_PARAMS for an empty key or value, a value over ``local_buffer_size``, a bad
        soft-pin config; NO_AVAILABLE_HANDLE when no tier has room."""
        return self._write(key, value, config, upsert=False, staged=True)

    def upsert(self, key: str, value: Any, config: ReplicateConfig = _DEFAULT) -> int:
        """Insert or replace (even a leased object, as Mooncake). Codes as ``put``."""
        return self._write(key, value, config, upsert=True, staged=True)

    def _batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig, upsert: bool
    ) -> int:
        if len(keys) != len(values):
            return INVALID_PARAMS
        if any(memoryview(v).nbytes == 0 for v in values):
            return INVALID_PARAMS  # Mooncake refuses the whole batch
        codes = self._write_all(list(zip(keys, values, strict=True)), config, upsert, True)
        return next((c for c in codes if c != 0), 0)

    def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig = _DEFAULT
    ) -> int:
        """0 if every put succeeded, else the first error (the others are still put)."""
        return self._batch(keys, values, config, False)

    def upsert_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig = _DEFAULT
    ) -> int:
        return self._batch(keys, values, config, True)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig = _DEFAULT) -> int:
        """The parts, concatenated, as one object (no parts: 0, nothing stored)."""
        views = [memoryview(p).cast("B") for p in parts]
        return self.put(key, b"".join(views), config) if views else 0

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig = _DEFAULT) -> int:
        views = [memoryview(p).cast("B") for p in parts]
        return self.upsert(key, b"".join(views), config) if views else 0

    def _from(self, ptr: int, size: int) -> np.ndarray | None:
        return None if ptr <= 0 or size <= 0 else self._dest(ptr, size)

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = _DEFAULT
    ) -> int:
        """Store ``size`` bytes at ``buffer_ptr``. A size of 0 returns 0 and stores nothing
        (as Mooncake)."""
        if size == 0:
            return 0
        view = self._from(buffer_ptr, size)
        return INVALID_PARAMS if view is None else self._write(key, view, config, False, False)

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig = _DEFAULT
    ) -> int:
        if size == 0:
            return 0
        view = self._from(buffer_ptr, size)
        return INVALID_PARAMS if view is None else self._write(key, view, config, True, False)

    def _batch_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], upsert: bool,
        config: ReplicateConfig,
    ) -> list[int]:  # fmt: skip
        if not len(keys) == len(ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._from(p, n) for p, n in zip(ptrs, sizes, strict=True)]
        good = [i for i, v in enumerate(views) if v is not None]
        codes = self._write_all([(keys[i], views[i]) for i in good], config, upsert, False)
        out = [INVALID_PARAMS] * len(keys)
        for i, code in zip(good, codes, strict=True):
            out[i] = code
        return out

    def batch_put_from(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
        config: ReplicateConfig = _DEFAULT,
    ) -> list[int]:  # fmt: skip
        return self._batch_from(keys, buffer_ptrs, sizes, False, config)

    def batch_upsert_from(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
        config: ReplicateConfig = _DEFAULT,
    ) -> list[int]:  # fmt: skip
        return self._batch_from(keys, buffer_ptrs, sizes, True, config)

    def put_from_with_metadata(
        self, key: str, buffer_ptr: int, metadata_buffer_ptr: int, size: int, metadata_size: int,
        config: ReplicateConfig = _DEFAULT,
    ) -> int:  # fmt: skip
        """One object: the metadata bytes, then the data bytes."""
        data, meta = self._from(buffer_ptr, size), self._from(metadata_buffer_ptr, metadata_size)
        if data is None or meta is None:
            return INVALID_PARAMS
        return self._write(key, meta.tobytes() + data.tobytes(), config, False, False)

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]], config: ReplicateConfig = _DEFAULT,
    ) -> list[int]:  # fmt: skip
        """Per key, its buffers concatenated as one object."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        out = []
        for key, ptrs, sizes in zip(keys, all_buffer_ptrs, all_sizes, strict=True):
            views = [self._from(p, s) for p, s in zip(ptrs, sizes, strict=False)]
            if len(ptrs) != len(sizes) or not views or any(v is None for v in views):
                out.append(INVALID_PARAMS)
                continue
            value = b"".join(v.tobytes() for v in views if v is not None)
            out.append(self._write(key, value, config, False, False))
        return out

    # ----------------------------------------------------------------- reads

    def _fetch(self, names: Sequence[str]) -> list[bytes | None]:
        """Each object's bytes (None: missing or a bad key); hits are leased."""
        member, _ = self._ready()
        out: list[bytes | None] = []
        for name in names:
            bkey = self._key(name)
            data = None if bkey is None else self._read_one(member, bkey)
            out.append(data)
        self._leases.grant(n for n, d in zip(names, out, strict=True) if d is not None)
        return out

    def _read_one(self, member: ClusterMember, bkey: bytes) -> bytes | None:
        nbytes = self._sizes.get(bkey)
        for _ in range(2):  # a second time if the size hint was stale
            if nbytes is None:
                nbytes = member.size_of(bkey)
            if nbytes is None:
                return None
            out = bytearray(nbytes)
            fetched = member.read_fitting([bkey], [np.frombuffer(out, np.uint8)], [nbytes])[0]
            if not fetched.too_small:
                return bytes(out[: fetched.nbytes]) if fetched.source is not None else None
            nbytes = fetched.nbytes
        return None

    def get(self, key: str) -> bytes:
        """The object's bytes, or b"" if it is missing."""
        return self._fetch([key])[0] or b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Per key ``get``; an empty list gives ``[b""]`` (as Mooncake)."""
        return [d or b"" for d in self._fetch(keys)] if keys else [b""]

    def get_buffer(self, key: str) -> BufferHandle | None:
        data = self._fetch([key])[0]
        return None if data is None else BufferHandle(data)

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        return [None if d is None else BufferHandle(d) for d in self._fetch(keys)]

    def get_size(self, key: str) -> int:
        """The object's size, or OBJECT_NOT_FOUND (also for an empty key)."""
        member, _ = self._ready()
        bkey = self._key(key)
        if bkey is None:
            return OBJECT_NOT_FOUND
        known = self._sizes.get(bkey)
        size = known if known is not None and member.store.shard.exists(bkey) else None
        size = size if size is not None else member.size_of(bkey)
        if size is None:
            return OBJECT_NOT_FOUND
        self._leases.grant([key])
        return size

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into ``buffer_ptr``; OBJECT_NOT_FOUND; INVALID_PARAMS for a buffer
        smaller than the object, a size of 0 or a null pointer."""
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
        for i, (key, ptr, size) in enumerate(zip(keys, buffer_ptrs, sizes, strict=True)):
            bkey = self._key(key)
            view = self._dest(ptr, size)
            if bkey is None:
                out[i] = OBJECT_NOT_FOUND
            elif view is not None:
                idx.append(i)
                bkeys.append(bkey)
                views.append(view)
        if not idx:
            return out
        hints = self._sizes
        got = member.read_fitting(bkeys, views, [hints.get(k) for k in bkeys])
        hits = []
        for i, bkey, fetched in zip(idx, bkeys, got, strict=True):
            if fetched.source is not None:
                out[i] = fetched.nbytes
                hits.append(keys[i])
                if fetched.source != "remote":
                    hints[bkey] = fetched.nbytes
            elif fetched.too_small:
                out[i] = INVALID_PARAMS
                hits.append(keys[i])  # Mooncake leases on the lookup, before the size check
            else:
                out[i] = OBJECT_NOT_FOUND
        self._leases.grant(hits)
        return out

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]], prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:  # fmt: skip
        """Per key, the object scattered over its buffers in order: its size; INVALID_PARAMS
        if the buffers are smaller than it, TRANSFER_FAIL if larger (as Mooncake)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        out = []
        for ptrs, sizes, data in zip(all_buffer_ptrs, all_sizes, self._fetch(keys), strict=True):
            total = sum(sizes)
            if data is None:
                out.append(OBJECT_NOT_FOUND)
            elif len(ptrs) != len(sizes) or total < len(data) or min(sizes, default=0) <= 0:
                out.append(INVALID_PARAMS)
            elif total > len(data):
                out.append(TRANSFER_FAIL)
            else:
                at = 0
                for ptr, size in zip(ptrs, sizes, strict=True):
                    view_at(ptr, size)[:] = np.frombuffer(data, np.uint8, size, at)
                    at += size
                out.append(len(data))
        return out

    def get_into_ranges(
        self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
        all_src_offsets: Sequence[Sequence[Sequence[int]]],
        all_sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:  # fmt: skip
        """Byte ranges of objects into registered buffers: per buffer, per key, per range
        the bytes copied or a code (OBJECT_NOT_FOUND; INVALID_PARAMS for an unregistered
        buffer, mismatched lists, a range past the object or the registered buffer)."""
        self._ready()
        n = len(buffer_ptrs)
        if not n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            return [[[INVALID_PARAMS]] for _ in range(n)]
        out: list[list[list[int]]] = []
        for ptr, keys, dsts, srcs, sizes in zip(
            buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes, strict=True
        ):
            out.append(self._ranges(ptr, keys, dsts, srcs, sizes))
        return out

    def _ranges(
        self, ptr: int, keys: Sequence[str], dsts: Sequence[Sequence[int]],
        srcs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
    ) -> list[list[int]]:  # fmt: skip
        room = self._regions.room(ptr)
        if not room or not len(keys) == len(dsts) == len(srcs) == len(sizes):
            return [[INVALID_PARAMS] * max(1, len(d)) for d in dsts] or [[INVALID_PARAMS]]
        dest = view_at(ptr, room)
        out: list[list[int]] = []
        for dst, src, size, data in zip(dsts, srcs, sizes, self._fetch(keys), strict=True):
            if not len(dst) == len(src) == len(size):
                out.append([INVALID_PARAMS] * max(1, len(dst)) if dst or src or size else [])
                continue
            if data is None:
                out.append([OBJECT_NOT_FOUND] * len(dst))
                continue
            row = []
            for d, s, m in zip(dst, src, size, strict=True):
                if d < 0 or s < 0 or m < 0 or s + m > len(data) or d + m > room:
                    row.append(INVALID_PARAMS)
                else:
                    dest[d : d + m] = np.frombuffer(data, np.uint8, m, s)
                    row.append(m)
            out.append(row)
        return out

    def is_exist(self, key: str) -> int:
        """1 held (here or by a live member; the object is leased), 0 not (or an empty key)."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        member, _ = self._ready()
        bkeys = [self._key(k) for k in keys]
        valid = [b for b in bkeys if b is not None]
        held = iter(member.present(valid) if valid else [])
        out = [0 if b is None else int(next(held)) for b in bkeys]
        self._leases.grant(k for k, hit in zip(keys, out, strict=True) if hit)
        return out

    # ----------------------------------------------------------------- removal

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed (this process's copy); OBJECT_NOT_FOUND; OBJECT_HAS_LEASE for an object
        read within the lease TTL (unless ``force``). Pins never block a remove."""
        member, _ = self._ready()
        bkey = self._key(key)
        if bkey is None or not member.store.shard.exists(bkey):
            return OBJECT_NOT_FOUND
        if not force and self._leases.leased(key):
            return OBJECT_HAS_LEASE
        if member.remove([bkey]) != 1:
            return OBJECT_HAS_LEASE  # a peer is reading it this instant
        with self._lock:
            self._names.pop(key, None)
            self._sizes.pop(bkey, None)
        self._leases.forget(key)
        return 0

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return [self.remove(k, force) for k in keys]

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects whose names match (``re.search``) were removed (leased ones stay
        unless ``force``); INVALID_PARAMS for a bad pattern."""
        try:
            pattern = re.compile(regex_pattern)
        except (re.error, TypeError):
            return INVALID_PARAMS
        with self._lock:
            names = [n for n in self._names if pattern.search(n)]
        return sum(self.remove(n, force) == 0 for n in names)

    def remove_all(self, force: bool = False) -> int:
        """Remove every object of this process's shard (leased ones stay unless ``force``);
        how many."""
        member, _ = self._ready()
        with self._lock:
            names = list(self._names)
        removed = sum(self.remove(n, force) == 0 for n in names)
        with self._lock:
            kept = set(self._names.values())
        rest = [k for k, _ in member.store.shard.holdings() if k not in kept]
        return removed + member.remove(rest)

    # ----------------------------------------------------------------- tensors

    def _put_tensor(self, key: str, tensor: Any, config: ReplicateConfig, upsert: bool) -> int:
        try:
            raw = tensors.encode(tensor)
        except ValueError as exc:
            logger.warning("put_tensor key=%s: %s", key, exc)
            return INVALID_PARAMS
        return self._write(key, raw, config, upsert, staged=True)

    def put_tensor(self, key: str, tensor: Any) -> int:
        """A CPU torch tensor as one object in Mooncake's tensor format."""
        return self._put_tensor(key, tensor, _DEFAULT, False)

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig = _DEFAULT) -> int:
        return self._put_tensor(key, tensor, config, False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensor(key, tensor, _DEFAULT, True)

    def upsert_pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig = _DEFAULT) -> int:
        return self._put_tensor(key, tensor, config, True)

    def _tensor_batch(
        self, keys: Sequence[str], items: Sequence[Any], one: Callable[[str, Any], int]
    ) -> list[int]:
        if len(keys) != len(items):
            return [INVALID_PARAMS] * len(keys)
        return [one(k, t) for k, t in zip(keys, items, strict=True)]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._tensor_batch(keys, tensors_list, self.put_tensor)

    def batch_pub_tensor(
        self, keys: Sequence[str], tensors_list: Sequence[Any], config: ReplicateConfig = _DEFAULT
    ) -> list[int]:
        return self._tensor_batch(keys, tensors_list, lambda k, t: self.pub_tensor(k, t, config))

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._tensor_batch(keys, tensors_list, self.upsert_tensor)

    def batch_upsert_pub_tensor(
        self, keys: Sequence[str], tensors_list: Sequence[Any], config: ReplicateConfig = _DEFAULT
    ) -> list[int]:
        return self._tensor_batch(
            keys, tensors_list, lambda k, t: self.upsert_pub_tensor(k, t, config)
        )

    def get_tensor(self, key: str) -> Any:
        """The tensor, or None (missing, or not a tensor object)."""
        data = self._fetch([key])[0]
        return None if data is None else tensors.decode(data)

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        return [None if d is None else tensors.decode(d) for d in self._fetch(keys)]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """The tensor read into the buffer (a view of it), or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[Any]:
        codes = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [
            tensors.decode(view_at(p, n), copy=False) if n > 0 else None
            for p, n in zip(buffer_ptrs, codes, strict=False)
        ]

    def _tensor_from(self, key: str, ptr: int, size: int, upsert: bool) -> int:
        view = self._from(ptr, size)
        if view is None or tensors.decode(view, copy=False) is None:
            return INVALID_PARAMS
        return self._write(key, view, _DEFAULT, upsert, staged=False)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """A tensor object already in Mooncake's format at ``buffer_ptr`` (as
        ``get_tensor_into`` leaves it); INVALID_PARAMS if it is not one."""
        return self._tensor_from(key, buffer_ptr, size, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._tensor_from(key, buffer_ptr, size, True)

    def batch_put_tensor_from(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return [self.put_tensor_from(*a) for a in zip(keys, buffer_ptrs, sizes, strict=True)]

    def batch_upsert_tensor_from(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        return [self.upsert_tensor_from(*a) for a in zip(keys, buffer_ptrs, sizes, strict=True)]

    def _put_tp(
        self, key: str, tensor: Any, config: ReplicateConfig, tp_size: int, split_dim: int
    ) -> int:
        parts = tensors.shards(tensor, tp_size, split_dim)
        if parts is None:
            return INVALID_PARAMS
        codes = [self._write(f"{key}_tp_{r}", p, config, False, True) for r, p in enumerate(parts)]
        return next((c for c in codes if c != 0), 0)

    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """Every rank's shard, split evenly along ``split_dim``, under ``key_tp_<rank>``;
        INVALID_PARAMS for an uneven split."""
        return self._put_tp(key, tensor, _DEFAULT, tp_size, split_dim)

    def pub_tensor_with_tp(
        self, key: str, tensor: Any, config: ReplicateConfig = _DEFAULT, tp_rank: int = 0,
        tp_size: int = 1, split_dim: int = 0,
    ) -> int:  # fmt: skip
        return self._put_tp(key, tensor, config, tp_size, split_dim)

    def batch_put_tensor_with_tp(
        self, base_keys: Sequence[str], tensors_list: Sequence[Any], tp_rank: int = 0,
        tp_size: int = 1, split_dim: int = 0,
    ) -> list[int]:  # fmt: skip
        return self._tensor_batch(
            base_keys, tensors_list, lambda k, t: self._put_tp(k, t, _DEFAULT, tp_size, split_dim)
        )

    def batch_pub_tensor_with_tp(
        self, base_keys: Sequence[str], tensors_list: Sequence[Any],
        config: ReplicateConfig = _DEFAULT, tp_rank: int = 0, tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:  # fmt: skip
        return self._tensor_batch(
            base_keys, tensors_list, lambda k, t: self._put_tp(k, t, config, tp_size, split_dim)
        )

    def put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:  # fmt: skip
        view = self._from(buffer_ptr, size)
        tensor = None if view is None else tensors.decode(view)
        return (
            INVALID_PARAMS
            if tensor is None
            else self._put_tp(key, tensor, _DEFAULT, tp_size, split_dim)
        )

    def batch_put_tensor_with_tp_from(
        self, base_keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
        tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0,
    ) -> list[int]:  # fmt: skip
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(base_keys)
        return [
            self.put_tensor_with_tp_from(k, p, s, tp_rank, tp_size, split_dim)
            for k, p, s in zip(base_keys, buffer_ptrs, sizes, strict=True)
        ]

    @staticmethod
    def _tp_key(key: str, tp_rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """Rank ``tp_rank``'s shard (``key`` itself when ``tp_size`` is 1), or None."""
        return self.get_tensor(self._tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(
        self, base_keys: Sequence[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[Any]:
        return self.batch_get_tensor([self._tp_key(k, tp_rank, tp_size) for k in base_keys])

    def get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1,
        split_dim: int = 0,
    ) -> Any:  # fmt: skip
        return self.get_tensor_into(self._tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(
        self, base_keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
        tp_rank: int = 0, tp_size: int = 1,
    ) -> list[Any]:  # fmt: skip
        keys = [self._tp_key(k, tp_rank, tp_size) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """CUDA destinations need a CUDA build: INVALID_PARAMS, as Mooncake's CPU wheel."""
        return INVALID_PARAMS

    def batch_get_tensor_into_cuda(
        self, keys: Sequence[str], tensors_list: Sequence[Any]
    ) -> list[int]:
        return [INVALID_PARAMS] * len(keys)

    # The TensorParallelism / ReadTarget family: without a parallelism request these are
    # the plain tensor calls (as Mooncake's); a request is NOT_SUPPORTED here.

    def put_tensor_with_parallelism(
        self, key: str, tensor: Any, parallelism: Any = None, config: ReplicateConfig = _DEFAULT,
        writer_partition: Any = None,
    ) -> int:  # fmt: skip
        if parallelism is not None or writer_partition is not None:
            return NOT_SUPPORTED
        return self.pub_tensor(key, tensor, config)

    def upsert_tensor_with_parallelism(
        self, key: str, tensor: Any, parallelism: Any = None, config: ReplicateConfig = _DEFAULT,
        writer_partition: Any = None,
    ) -> int:  # fmt: skip
        if parallelism is not None or writer_partition is not None:
            return NOT_SUPPORTED
        return self.upsert_pub_tensor(key, tensor, config)

    def batch_put_tensor_with_parallelism(
        self, keys: Sequence[str], tensors_list: Sequence[Any], parallelisms: Any = None,
        config: ReplicateConfig = _DEFAULT, writer_partitions: Any = None,
    ) -> list[int]:  # fmt: skip
        if parallelisms is not None or writer_partitions is not None:
            return [NOT_SUPPORTED] * len(keys)
        return self.batch_pub_tensor(keys, tensors_list, config)

    def batch_upsert_tensor_with_parallelism(
        self, keys: Sequence[str], tensors_list: Sequence[Any], parallelisms: Any = None,
        config: ReplicateConfig = _DEFAULT, writer_partitions: Any = None,
    ) -> list[int]:  # fmt: skip
        if parallelisms is not None or writer_partitions is not None:
            return [NOT_SUPPORTED] * len(keys)
        return self.batch_upsert_pub_tensor(keys, tensors_list, config)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        return self.get_tensor(key) if target is None else None

    def batch_get_tensor_with_parallelism(
        self, keys: Sequence[str], targets: Any = None
    ) -> list[Any]:
        return self.batch_get_tensor(keys) if targets is None else [None] * len(keys)

    # ----------------------------------------------------------------- not served here

    def get_replica_desc(self, key: str) -> list[Any]:
        """Mooncake's segment descriptors do not exist here: always []."""
        return []

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[Any]]:
        return {}

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        return {"ret": INTERNAL_ERROR, "segment_ids": []}

    def allocate_and_mount_segment(
        self, size: int, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        return {"ret": INTERNAL_ERROR, "segment_ids": []}

    def unmount_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED

    def unmount_and_free_segment(
        self, segment_ids: Sequence[str], grace_period_seconds: int = 0
    ) -> int:
        return NOT_SUPPORTED

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        return NOT_SUPPORTED

    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[tuple[int, int], int]:
        return (0, 0), NOT_SUPPORTED

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        return (0, 0), NOT_SUPPORTED

    def query_task(self, task_id: tuple[int, int]) -> tuple[None, int]:
        return None, NOT_SUPPORTED

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        return []

    def get_offload_rpc_read_count(self) -> int:
        return 0

    def alloc_from_mem_pool(self, size: int) -> int:
        return 0

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        return NOT_SUPPORTED

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        return NOT_SUPPORTED


# Module-level enum values, as mooncake.store exports them (FAILED and PROCESSING are
# TaskStatus's there too).
UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE = list(ObjectDataType)[:5]
ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA, GENERAL = list(ObjectDataType)[5:]
UNDEFINED, INITIALIZED, COMPLETE, REMOVED = (
    ReplicaStatus.UNDEFINED, ReplicaStatus.INITIALIZED, ReplicaStatus.COMPLETE,
    ReplicaStatus.REMOVED,
)  # fmt: skip
PENDING, PROCESSING, FAILED, SUCCESS = list(TaskStatus)
REPLICA_COPY, REPLICA_MOVE = list(TaskType)

__all__ = [
    "ACTIVATION",
    "BUFFER_OVERFLOW",
    "COMPLETE",
    "FAILED",
    "GENERAL",
    "GRADIENT",
    "INITIALIZED",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "KVCACHE",
    "METADATA",
    "NOT_SUPPORTED",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "OBJECT_NOT_FOUND",
    "OPTIMIZER_STATE",
    "PENDING",
    "PROCESSING",
    "REMOVED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
    "SAMPLE",
    "SUCCESS",
    "TENSOR",
    "TRANSFER_FAIL",
    "UNDEFINED",
    "UNKNOWN",
    "WEIGHT",
    "BufferHandle",
    "ErrorCode",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
]
