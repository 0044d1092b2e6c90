"""MemberConfig: what another engine's process contributes to a kvflow cluster.

Built by the SGLang backend from SGLang's ``--hicache-storage-backend-extra-config`` and by the
Mooncake-compatible store from ``setup()``'s arguments (``from_mapping`` names the keys).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvflow.kvdb.config import ENGINES
from kvflow.kvdb.manifest import engine_for

_NODE_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class MemberConfig:
    """One member process (frozen; bad values raise ValueError naming the field).

    node_id: the member's name in the metadata; keep it stable across restarts so the SSD
        tier is re-adopted under the same name. meta: the metadata replicas' gRPC addresses
        ("host:port"); empty = an embedded store (this process only, no peers). host: the
        address the member's gRPC and transfer servers bind and advertise (127.0.0.1 keeps a
        member on one machine). port / transfer_port: 0 = any free port. data_dir: the
        shard's SSD files and manifest; None = an in-memory SSD engine (nothing survives a
        restart). dram_bytes / ssd_bytes: the DRAM pool and SSD budget this process gives
        the cluster; both 0 (clustered only) = a client that holds nothing: its puts go to
        peers (a Mooncake client with no segment). engine: "lmdb", "rocksdb" or "memory";
        None (the default): "memory" without a data_dir, else the engine the shard's
        directory already holds, else kvdb's ``DEFAULT_ENGINE`` (``store_engine``).
        tenant: the key namespace's tenant (tenants never see each other's blocks).
        heartbeat_s: the member's heartbeat period; peer_dead_after_s: a peer whose last
        heartbeat is older is not read from. dram_prefault: touch every page of the DRAM
        pool when the member opens (the pool is committed memory from the start; no page
        fault on the put path). verify_dram_hits: checksum every read of this member's own
        DRAM blocks (SSD and peer reads are verified always; see kvdb's StoreConfig).
        same_host_shm: read a peer on this host by mapping its DRAM pool (one memcpy,
        ``kvflow/transfer/README.md``); False: over tcp like any peer.
    """

    node_id: str
    meta: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    transfer_port: int = 0
    data_dir: Path | None = None
    dram_bytes: int = 256 << 20
    ssd_bytes: int = 1 << 30
    engine: str | None = None
    tenant: str = "default"
    heartbeat_s: float = 1.0
    peer_dead_after_s: float = 5.0
    dram_prefault: bool = False
    verify_dram_hits: bool = True
    same_host_shm: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not _NODE_RE.fullmatch(self.node_id):
            raise ValueError(
                f"node_id must be 1-128 characters of [A-Za-z0-9_.:-], got {self.node_id!r}"
            )
        if isinstance(self.meta, str) or not all(
            isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in self.meta
        ):
            raise ValueError(f"meta must be a tuple of 'host:port' strings, got {self.meta!r}")
        for name in ("port", "transfer_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an int in [0, 65535], got {value!r}")
        for name in ("dram_bytes", "ssd_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.dram_bytes == 0 and self.ssd_bytes == 0 and not self.meta:
            raise ValueError(
                "dram_bytes and ssd_bytes: at least one tier must have room (both 0 = a "
                "client that holds nothing, which needs meta)"
            )
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {self.engine!r}")
        if self.engine not in (None, "memory") and self.data_dir is None:
            raise ValueError(f"data_dir is required for engine {self.engine!r} (or use 'memory')")
        if not isinstance(self.tenant, str) or not _TENANT_RE.fullmatch(self.tenant):
            raise ValueError(
                f"tenant must be 1-64 characters of [A-Za-z0-9_.-], got {self.tenant!r}"
            )
        for name in ("dram_prefault", "verify_dram_hits", "same_host_shm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s!r}")
        if not self.peer_dead_after_s > self.heartbeat_s:
            raise ValueError(
                f"peer_dead_after_s must exceed heartbeat_s, got {self.peer_dead_after_s!r}"
            )

    @property
    def shard_dir(self) -> Path | None:
        """The shard's directory under ``data_dir`` (None without one)."""
        return None if self.data_dir is None else self.data_dir / "shards" / self.node_id

    @property
    def store_engine(self) -> str:
        """The SSD engine the member's shard opens with (see ``engine``)."""
        if self.engine is None and self.data_dir is None:
            return "memory"
        return engine_for(self.shard_dir, self.engine)

    @property
    def clustered(self) -> bool:
        return bool(self.meta)

    @property
    def holds_nothing(self) -> bool:
        """A client member: no tier has room; every put is pushed to peers."""
        return self.dram_bytes == 0 and self.ssd_bytes == 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], **defaults: Any) -> MemberConfig:
        """A config from a JSON-like mapping with the ``kvflow_`` prefixed keys
        (``kvflow_meta`` "a:1,b:2" or a list, ``kvflow_node_id``, ``kvflow_host``,
        ``kvflow_port``, ``kvflow_transfer_port``, ``kvflow_data_dir``, ``kvflow_dram_bytes``,
        ``kvflow_ssd_bytes``, ``kvflow_engine``, ``kvflow_tenant``, ``kvflow_heartbeat_s``,
        ``kvflow_peer_dead_after_s``, ``kvflow_dram_prefault``, ``kvflow_verify_dram_hits``,
        ``kvflow_same_host_shm``);
        other keys are ignored. ``defaults`` fill fields the mapping leaves out. Raises
        ValueError naming the key."""
        known = {f.name for f in fields(cls)}
        args: dict[str, Any] = dict(defaults)
        for key, value in values.items():
            if not key.startswith("kvflow_"):
                continue
            name = key[len("kvflow_") :]
            if name not in known:
                raise ValueError(f"{key}: unknown kvflow option (known: {sorted(known)})")
            args[name] = value
        meta = args.get("meta", ())
        if isinstance(meta, str):
            meta = tuple(a.strip() for a in meta.split(",") if a.strip())
        args["meta"] = tuple(meta)
        if args.get("data_dir") is not None:
            args["data_dir"] = Path(args["data_dir"])
        return cls(**args)


__all__ = ["MemberConfig"]
