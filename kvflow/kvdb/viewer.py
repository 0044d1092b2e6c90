"""Viewer: who reads the kvdb admin service, and which tenant's blocks they may see.

kvdb knows nothing of API keys: the server that mounts the admin service turns each call's
metadata into a Viewer (``add_admin_service(..., viewer_of=...)``; the inference server does
it from the caller's API key). Without one every caller is an admin (intra-cluster servers,
whose every RPC needs the cluster token).

An admin sees every tenant and may name one to filter; a user sees only its own tenant and
may not call the RPCs that act on or reveal the whole cluster (Nodes, Shards, Tiers, Evict).
Pure data, thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.kvdb.errors import AccessDeniedError, InvalidRequestError
from kvflow.kvdb.keys import check_tenant


@dataclass(frozen=True)
class Viewer:
    """``tenant`` None: an admin; a tenant name: a user who sees only that tenant's blocks."""

    tenant: str | None = None

    def __post_init__(self) -> None:
        if self.tenant is not None:
            check_tenant(self.tenant, "Viewer.tenant")

    @property
    def admin(self) -> bool:
        return self.tenant is None

    def require_admin(self, rpc: str) -> None:
        """AccessDeniedError unless an admin: ``rpc`` acts on or reveals the whole cluster."""
        if not self.admin:
            raise AccessDeniedError(
                f"{rpc} shows or changes every tenant's blocks: it needs an admin key"
            )

    def scope(self, requested: str) -> str | None:
        """The tenant a view is filtered to (None: every tenant). ``requested``: the request's
        ``tenant`` field. A user gets its own tenant (naming another is AccessDeniedError); an
        admin gets what it names (InvalidRequestError for a malformed name), or everything."""
        if self.tenant is not None:
            if requested and requested != self.tenant:
                raise AccessDeniedError(f"this key may not view tenant {requested!r:.80}")
            return self.tenant
        if not requested:
            return None
        try:
            return check_tenant(requested)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None


ADMIN = Viewer()
"""Every caller of a server that does not say otherwise."""

__all__ = ["ADMIN", "Viewer"]
