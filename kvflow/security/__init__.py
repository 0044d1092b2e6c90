"""Cluster trust and client identity: the one cluster secret, the authenticated gRPC channels
between kvflow processes, and API keys (see ``docs/security.md``).

A leaf package: it imports nothing of kvflow, so every other package may build on it.
"""

from kvflow.security.secret import (
    SECRET_FILE_ENV,
    ClusterSecret,
    generate_secret_file,
    load_secret_file,
    process_secret,
)

__all__ = [
    "SECRET_FILE_ENV",
    "ClusterSecret",
    "generate_secret_file",
    "load_secret_file",
    "process_secret",
]
