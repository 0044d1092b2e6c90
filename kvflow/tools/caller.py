"""How a CLI command calls a server as someone: ``--api-key KEY`` or the cluster token.

With ``--api-key`` the command opens a channel without the cluster token and sends
``authorization: Bearer KEY`` on every call, so the key decides who the caller is (a user key
sees only its tenant). Without
one it sends this process's cluster token (``--cluster-secret-file`` / the environment), which
makes it an admin of a keyed server; with neither, a keyed server answers UNAUTHENTICATED.
Either way the channel is TLS when this process has a CA (``--tls-ca`` / the environment).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import grpc

from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel


def add_api_key_flag(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument(
        "--api-key", default=None, help="call with this API key (Bearer); default: cluster token"
    )


def open_channel(server: str, api_key: str | None) -> grpc.Channel:
    """A channel to ``server`` for calls made with ``api_key`` (see the module doc); the
    caller closes it."""
    return cluster_channel(server, None if api_key else process_secret())


class KeyedStub:
    """A generated stub whose every call also sends ``api_key`` as Bearer metadata (none:
    the stub's calls unchanged)."""

    def __init__(self, stub: Any, api_key: str | None) -> None:
        self._stub = stub
        self._metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        return (
            method if self._metadata is None else functools.partial(method, metadata=self._metadata)
        )
