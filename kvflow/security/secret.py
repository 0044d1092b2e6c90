"""The cluster secret: one file of random bytes that every process of a cluster reads.

Every intra-cluster channel derives its own key from it (``derive(label)``), so a key that
leaks from one channel (e.g. the gRPC token, which travels in metadata) is not the key of
another (the transfer handshake, pysyncobj's password).

The secret is passed to child processes *by path* (``KVFLOW_CLUSTER_SECRET_FILE`` or
``--cluster-secret-file``), never as a value on a command line, where ``ps`` shows it. The
environment variable is read here and nowhere else.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

SECRET_FILE_ENV = "KVFLOW_CLUSTER_SECRET_FILE"
"""Names the secret file of the cluster this process belongs to."""

MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class ClusterSecret:
    """The shared secret of one cluster (immutable; share it freely).

    ``value`` is the raw secret (at least 16 bytes); ``repr`` never shows it.
    """

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes) or len(self.value) < MIN_SECRET_BYTES:
            raise ValueError(f"value: the cluster secret needs at least {MIN_SECRET_BYTES} bytes")

    def derive(self, label: str) -> bytes:
        """A 32-byte key for one channel (``label`` names it: "raft", "grpc", "transfer")."""
        return hmac.new(self.value, b"kvflow/" + label.encode(), hashlib.sha256).digest()

    def grpc_token(self) -> str:
        """The token a kvflow process sends in gRPC metadata to another (hex)."""
        return self.derive("grpc").hex()

    def raft_password(self) -> str:
        """pysyncobj's password (its messages are encrypted and authenticated with it)."""
        return self.derive("raft").hex()

    def transfer_key(self) -> bytes:
        """The key of the transfer engine's challenge-response handshake."""
        return self.derive("transfer")


def generate_secret_file(path: Path) -> ClusterSecret:
    """Write a new random secret to ``path`` (mode 0600). The file appears whole or not at
    all (written aside, then hard-linked into place), and an existing file is an error
    (FileExistsError), so a cluster's secret is never overwritten and two processes that
    generate at once agree on the winner's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_bytes(32)
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(value.hex().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(aside, path)
    finally:
        aside.unlink(missing_ok=True)
    return ClusterSecret(value)


def load_secret_file(path: Path) -> ClusterSecret:
    """Read a secret file (hex, or raw bytes of at least 16); ValueError naming the file when
    it is too short, or readable by other users."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise ValueError(f"{path}: a cluster secret file must be private (chmod 600)")
    raw = path.read_bytes().strip()
    try:
        value = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        value = raw
    try:
        return ClusterSecret(value)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> ClusterSecret:
    return load_secret_file(Path(path))


def process_secret() -> ClusterSecret | None:
    """The secret of this process's cluster, from ``KVFLOW_CLUSTER_SECRET_FILE``; ``None``
    when it is unset (a process that runs open, for local development)."""
    path = os.environ.get(SECRET_FILE_ENV)
    return _load_cached(path) if path else None
