"""TransferConfig: every knob of the transfer engine and its backends, validated on construction."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from kvflow.security import process_secret

_ENGINE_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


def _random_engine_name() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class TransferConfig:
    """Configuration of one TransferEngine (immutable; share it freely).

    engine_name: names this engine on its host: its shared segments are served on the abstract
        socket ``kvflow-shm-<engine_name>`` and same-host peers open them as
        ``shm://<engine_name>``. Letters, digits, ``_`` and ``-``, 1-32 characters. Random when
        not given.
    connections_per_peer: tcp connections (lanes) opened to each peer; slices of one request are
        spread round-robin over them. The paper's "several NICs" (>= 1).
    slice_size: a tcp request longer than this is cut into slices of this many bytes (>= 4096).
    max_endpoints: cap on open tcp connections over all peers; beyond it the SIEVE policy picks
        the connection to close (>= 1).
    connect_timeout_s: how long opening one connection may take before the path counts as down.
    io_timeout_s: a connection with work in flight that makes no progress for this long is
        treated as failed (its slices are retried on another path).
    request_timeout_s: deadline of one request from submit; past it the request ends TIMEOUT.
    max_retries: how many times one slice may be re-sent after a connection failure (>= 0).
    path_retry_s: a path (address) that failed is avoided for this long when others are up.
    prefer_shm: when a tcp peer turns out to be on this host and the segment is a shared pool,
        open_segment maps it through the peer's shm socket instead (one memcpy, no socket
        copies; the same key check); it falls back to tcp where that fails.
    max_batch_capacity: the largest capacity allocate_batch accepts.
    socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF for tcp sockets; 0 leaves the OS default.
    server_backlog: listen() backlog of the server.
    max_server_connections: connections the server serves at once (one thread each); a
        connection beyond it is closed at once.
    secret: the key of the connection handshake (``transfer.handshake``): with it, every
        connection proves it holds the key before any segment byte moves, both ways. Default:
        derived from this process's cluster secret (``KVFLOW_CLUSTER_SECRET_FILE``); ``None``
        runs open.
    """

    engine_name: str = field(default_factory=_random_engine_name)
    connections_per_peer: int = 4
    slice_size: int = 1 << 20
    max_endpoints: int = 64
    connect_timeout_s: float = 2.0
    io_timeout_s: float = 5.0
    request_timeout_s: float = 30.0
    max_retries: int = 3
    path_retry_s: float = 1.0
    prefer_shm: bool = True
    max_batch_capacity: int = 1 << 16
    socket_buffer_bytes: int = 0
    server_backlog: int = 128
    max_server_connections: int = 256
    secret: bytes | None = field(default_factory=lambda: _process_transfer_key(), repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.engine_name, str) or not _ENGINE_NAME_RE.match(self.engine_name):
            raise ValueError(
                f"engine_name must match [A-Za-z0-9_-]{{1,32}}, got {self.engine_name!r}"
            )
        _require_int("connections_per_peer", self.connections_per_peer, 1)
        _require_int("slice_size", self.slice_size, 4096)
        _require_int("max_endpoints", self.max_endpoints, 1)
        _require_int("max_retries", self.max_retries, 0)
        _require_int("max_batch_capacity", self.max_batch_capacity, 1)
        _require_int("socket_buffer_bytes", self.socket_buffer_bytes, 0)
        _require_int("server_backlog", self.server_backlog, 1)
        _require_int("max_server_connections", self.max_server_connections, 1)
        key = self.secret
        if key is not None and (not isinstance(key, bytes) or len(key) < 16):
            raise ValueError("secret must be None or at least 16 bytes")
        for name in ("connect_timeout_s", "io_timeout_s", "request_timeout_s"):
            _require_positive_float(name, getattr(self, name))
        value = self.path_retry_s
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ValueError(f"path_retry_s must be a number >= 0, got {value!r}")
        if not isinstance(self.prefer_shm, bool):
            raise ValueError(f"prefer_shm must be a bool, got {self.prefer_shm!r}")


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _require_positive_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


def _process_transfer_key() -> bytes | None:
    secret = process_secret()
    return None if secret is None else secret.transfer_key()
