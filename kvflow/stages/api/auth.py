"""Client identity: the one place that turns a bearer token into an ``Identity``.

API keys come from a key file (one ``KEY TENANT ROLE`` per line, ``#`` comments; ROLE is
``user`` or ``admin``) or ``--api-key KEY`` (one admin key of the default tenant, as vLLM and
SGLang have it). A call carries its key as ``authorization: Bearer KEY`` (gRPC metadata here;
the HTTP front passes its header to :meth:`Authenticator.identify_bearer`). A kvflow process
that shows the cluster token (``security.grpc_auth``) is an admin.

The tenant of a request is the key's (:func:`tenant_for`); a user naming another tenant is
PERMISSION_DENIED; an admin may act for any tenant. What a user may read is filtered to its
tenant: the kvdb admin views (:func:`viewer_for`; the cluster-wide KVAdmin RPCs stay
admin-only) and the exported traces. With no keys configured every caller is an
admin of whatever tenant it names: the open mode for local development, logged at start-up.
Keys are kept as SHA-256 digests and compared in constant time.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from kvflow.kvdb import DEFAULT_TENANT, Viewer
from kvflow.security import ClusterSecret
from kvflow.security.grpc_auth import has_cluster_token

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
ADMIN_SERVICE_PREFIX = "/kvflow.kvdb.v1.KVAdmin/"
USER_ADMIN_METHODS = frozenset(ADMIN_SERVICE_PREFIX + name for name in ("Hot", "Replicas", "Stats"))
"""The KVAdmin RPCs a user key may call: they show it only its own tenant's blocks. The
others (Nodes, Shards, Tiers, Evict) act on or reveal the whole cluster."""
ADMIN_METHODS: frozenset[str] = frozenset()
"""Inference RPCs a user key may not call (none: ExportTrace shows a user its own requests)."""


class Role(enum.Enum):
    USER = "user"
    ADMIN = "admin"


@dataclass(frozen=True)
class Identity:
    """Who calls: ``tenant`` ("" = the default tenant) and ``role``."""

    tenant: str
    role: Role

    @property
    def admin(self) -> bool:
        return self.role is Role.ADMIN


OPEN = Identity("", Role.ADMIN)
"""Every caller, when no keys are configured."""


class Unauthenticated(Exception):
    """No key, or a key that is not known: UNAUTHENTICATED / 401."""


class PermissionDenied(Exception):
    """A known key asked for what its role or tenant does not allow: PERMISSION_DENIED / 403."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class ApiKeys:
    """Key digests -> identities (immutable). ``load`` reads a key file."""

    entries: tuple[tuple[bytes, Identity], ...]

    @staticmethod
    def single(key: str) -> ApiKeys:
        """``--api-key``: one admin key of the default tenant."""
        if not key:
            raise ValueError("api_key: must not be empty")
        return ApiKeys(((_digest(key), Identity("", Role.ADMIN)),))

    @staticmethod
    def load(path: Path) -> ApiKeys:
        entries = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) != 3 or fields[2] not in ("user", "admin"):
                raise ValueError(f"{path}:{n}: expected 'KEY TENANT user|admin'")
            key, tenant, role = fields
            if len(key) < 16:
                raise ValueError(f"{path}:{n}: a key needs at least 16 characters")
            tenant = "" if tenant == "-" else tenant
            entries.append((_digest(key), Identity(tenant, Role(role))))
        if not entries:
            raise ValueError(f"{path}: no keys")
        return ApiKeys(tuple(entries))

    def lookup(self, key: str) -> Identity | None:
        digest = _digest(key)
        found = None
        for known, identity in self.entries:  # every entry compared: constant time per key
            if hmac.compare_digest(known, digest):
                found = identity
        return found


class Authenticator:
    """Bearer token -> Identity. ``keys`` None: open mode. ``secret``: the cluster's, whose
    token makes a caller an admin. Immutable, thread-safe."""

    def __init__(self, keys: ApiKeys | None, secret: ClusterSecret | None = None) -> None:
        self.keys = keys
        self.secret = secret

    @property
    def open(self) -> bool:
        return self.keys is None

    def log_mode(self) -> None:
        if self.open:
            logger.warning(
                "no API keys configured: the inference API is OPEN to anyone who can reach it,"
                " and a request's tenant is whatever it names (local development only)"
            )
        else:
            logger.info("API keys required: %d keys", len(self.keys.entries))  # type: ignore[union-attr]

    def identify_bearer(self, authorization: str | None) -> Identity:
        """The identity of an ``Authorization`` header value; Unauthenticated without one
        that is known (in open mode: OPEN)."""
        if self.keys is None:
            return OPEN
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("give an API key: 'authorization: Bearer KEY'")
        identity = self.keys.lookup(key.strip())
        if identity is None:
            raise Unauthenticated("unknown API key")
        return identity

    def identify_metadata(self, metadata: Sequence[tuple[str, Any]] | None) -> Identity:
        """The identity of a gRPC call's metadata."""
        if self.secret is not None and has_cluster_token(metadata, self.secret):
            return OPEN
        value = next((v for k, v in metadata or () if k == AUTHORIZATION), None)
        return self.identify_bearer(value.decode() if isinstance(value, bytes) else value)


def tenant_for(identity: Identity, requested: str) -> str:
    """The tenant a request runs as: the key's; an admin may name another."""
    if identity.admin:
        return requested or identity.tenant
    if requested and requested != identity.tenant:
        raise PermissionDenied(f"this key may not act for tenant {requested!r}")
    return identity.tenant


def owner_tenant(identity: Identity) -> str:
    """The tenant whose blocks and requests ``identity`` owns ("" is the default tenant)."""
    return identity.tenant or DEFAULT_TENANT


def viewer_for(identity: Identity) -> Viewer:
    """What ``identity`` sees through the kvdb admin service: an admin everything, a user
    only its own tenant's blocks."""
    return Viewer() if identity.admin else Viewer(owner_tenant(identity))


def check_method(identity: Identity, method: str) -> None:
    """PermissionDenied when ``identity`` may not call the gRPC ``method``."""
    kvadmin = method.startswith(ADMIN_SERVICE_PREFIX) and method not in USER_ADMIN_METHODS
    admin_only = kvadmin or method in ADMIN_METHODS
    if admin_only and not identity.admin:
        raise PermissionDenied(f"{method} needs an admin key")


class AuthInterceptor(aio.ServerInterceptor):
    """The inference server's gate: UNAUTHENTICATED without a known key, PERMISSION_DENIED for
    an admin RPC with a user key, before any servicer runs."""

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or self._auth.open:
            return handler
        try:
            check_method(self._auth.identify_metadata(details.invocation_metadata), details.method)
        except Unauthenticated as exc:
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        except PermissionDenied as exc:
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return handler


def _refusal(handler: Any, code: grpc.StatusCode, details: str) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        await context.abort(code, details)

    async def stream(request: Any, context: Any) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover - abort raises

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
