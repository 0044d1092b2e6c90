"""How a CLI command calls a server as someone, and survives a router loss.

``--api-key KEY`` (or ``KVFLOW_API_KEY``): the command opens channels without the cluster
token and sends ``authorization: Bearer KEY`` on every call, so the key decides who the caller
is (a user key sees only its tenant). Without one it sends this process's cluster token
(``--cluster-secret-file`` / the environment), which makes it an admin of a keyed server; with
neither, a keyed server answers UNAUTHENTICATED. Either way the channel is TLS when this
process has a CA (``--tls-ca`` / the environment).

``--server A,B``: several routers of one cluster; a call that finds one unreachable goes to
the next, with backoff between rounds (``stages/api/failover.py``).
"""

from __future__ import annotations

import argparse
from typing import Any

from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel
from kvflow.stages.api.failover import API_KEY_ENV, FailoverStub, parse_servers, resolve_api_key

DEFAULT_SERVER = "127.0.0.1:50051"
# How long a command keeps retrying routers that refuse connections: a router restarted by its
# supervisor serves again within this on a loaded machine.
RETRY_FOR_S = 30.0
SERVER_HELP = "HOST:PORT of a server or router; several, comma-separated, to fail over"


def add_server_flag(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument("--server", default=DEFAULT_SERVER, help=SERVER_HELP)


def add_api_key_flag(p: argparse.ArgumentParser | Any) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help=f"call with this API key (Bearer); default: ${API_KEY_ENV}, else the cluster token",
    )


def open_stub(
    servers: str, stub_class: Any, api_key: str | None, retry_for_s: float = RETRY_FOR_S
) -> FailoverStub:
    """A stub of ``stub_class`` over the comma-separated ``servers`` (ValueError names a bad
    address), calling as ``api_key`` (None: ``KVFLOW_API_KEY``, else the cluster token). The
    caller closes it."""
    key = resolve_api_key(api_key)
    secret = None if key else process_secret()
    return FailoverStub(
        parse_servers(servers),
        stub_class,
        lambda server: cluster_channel(server, secret),
        api_key=key or "",
        retry_for_s=retry_for_s,
    )
