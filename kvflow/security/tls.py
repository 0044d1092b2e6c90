"""Optional TLS under the cluster token: how every kvflow server binds and every client
connects, decided here once.

A process *serves* TLS when it has a certificate and its key (``--tls-cert``/``--tls-key``,
or ``KVFLOW_TLS_CERT_FILE``/``KVFLOW_TLS_KEY_FILE``): its gRPC ports bind with
``add_secure_port`` and its HTTP front with uvicorn's ``ssl_certfile``/``ssl_keyfile``. A
process *connects* with TLS when it has a CA (``--tls-ca``, ``KVFLOW_TLS_CA_FILE``): every
channel it opens to another kvflow process verifies the server's certificate against it (the
address's host must be in the certificate's names). Servers do not ask clients for
certificates: a client proves itself with the cluster token (``grpc_auth``) or an API key,
sent inside the TLS channel, so TLS adds confidentiality and server authentication, and the
token stays the one credential of a kvflow process (see ``grpc_auth``'s doc for why).

The environment variables are read here and nowhere else (``process_tls``); ``tools/args``
sets them from the flags, and ``LocalCluster`` passes them to its children.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

TLS_CERT_ENV = "KVFLOW_TLS_CERT_FILE"
TLS_KEY_ENV = "KVFLOW_TLS_KEY_FILE"
TLS_CA_ENV = "KVFLOW_TLS_CA_FILE"


@dataclass(frozen=True)
class TlsSettings:
    """The TLS files of one process (immutable; share it freely). ``TlsSettings()`` is
    plaintext both ways.

    cert_file, key_file: the server certificate (PEM, may hold the chain) and its private key;
        both or neither. With them, this process's servers accept TLS only.
    ca_file: the CA bundle (PEM) that servers' certificates must chain to. With it, this
        process's clients connect with TLS only.
    """

    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "tls: give the certificate and its key together (--tls-cert, --tls-key)"
            )

    @property
    def serves_tls(self) -> bool:
        return self.cert_file is not None

    @property
    def connects_tls(self) -> bool:
        return self.ca_file is not None

    def check(self) -> None:
        """Read every file now; ValueError naming the file that is missing, unreadable or not
        PEM (so a process refuses to start, rather than failing its first call)."""
        for path, what in (
            (self.cert_file, "certificate"),
            (self.key_file, "key"),
            (self.ca_file, "CA"),
        ):
            if path is not None:
                read_pem(path, what)

    def env(self) -> dict[str, str]:
        """The environment variables that make these a child process's settings."""
        pairs = ((TLS_CERT_ENV, self.cert_file), (TLS_KEY_ENV, self.key_file))
        pairs += ((TLS_CA_ENV, self.ca_file),)
        return {name: str(Path(p).resolve()) for name, p in pairs if p is not None}


PLAINTEXT = TlsSettings()

ENV_NAMES = (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV)


def read_pem(path: Path, what: str) -> bytes:
    """The bytes of a PEM file; ValueError naming ``path`` and what it should hold."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the TLS {what} file: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{path}: the TLS {what} file is not PEM (no -----BEGIN line)")
    return data


def process_tls() -> TlsSettings:
    """This process's settings, from ``KVFLOW_TLS_*`` (plaintext when none is set)."""
    return _settings(*(os.environ.get(name) or None for name in ENV_NAMES))


@functools.lru_cache(maxsize=8)
def _settings(cert: str | None, key: str | None, ca: str | None) -> TlsSettings:
    return TlsSettings(*(None if p is None else Path(p) for p in (cert, key, ca)))


# --- credentials --------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _server_credentials(settings: TlsSettings) -> grpc.ServerCredentials:
    assert settings.cert_file is not None and settings.key_file is not None
    pair = (read_pem(settings.key_file, "key"), read_pem(settings.cert_file, "certificate"))
    return grpc.ssl_server_credentials([pair])


@functools.lru_cache(maxsize=8)
def _channel_credentials(settings: TlsSettings) -> grpc.ChannelCredentials:
    assert settings.ca_file is not None
    return grpc.ssl_channel_credentials(root_certificates=read_pem(settings.ca_file, "CA"))


def add_port(server: grpc.Server | aio.Server, address: str, settings: TlsSettings | None) -> int:
    """Bind ``server`` to ``address`` with TLS when ``settings`` (None: this process's)
    serve it, else plaintext; the bound port, 0 when it could not bind (gRPC's contract)."""
    settings = process_tls() if settings is None else settings
    if settings.serves_tls:
        return server.add_secure_port(address, _server_credentials(settings))
    return server.add_insecure_port(address)


def channel(
    address: str, options: Sequence[tuple[str, Any]] = (), settings: TlsSettings | None = None
) -> grpc.Channel:
    """A synchronous channel to ``address``: TLS verified against the CA when ``settings``
    (None: this process's) have one, else plaintext. The caller closes it."""
    settings = process_tls() if settings is None else settings
    if settings.connects_tls:
        return grpc.secure_channel(address, _channel_credentials(settings), list(options))
    return grpc.insecure_channel(address, list(options))


def aio_channel(
    address: str,
    options: Sequence[tuple[str, Any]] = (),
    settings: TlsSettings | None = None,
    interceptors: Sequence[Any] = (),
) -> aio.Channel:
    """The ``grpc.aio`` twin of :func:`channel`."""
    settings = process_tls() if settings is None else settings
    if settings.connects_tls:
        return aio.secure_channel(
            address,
            _channel_credentials(settings),
            list(options),
            interceptors=list(interceptors),
        )
    return aio.insecure_channel(address, list(options), interceptors=list(interceptors))


def uvicorn_ssl(settings: TlsSettings | None = None) -> dict[str, str]:
    """uvicorn.Config keyword arguments for an HTTPS front (empty: plain HTTP)."""
    settings = process_tls() if settings is None else settings
    if not settings.serves_tls:
        return {}
    settings.check()
    return {"ssl_certfile": str(settings.cert_file), "ssl_keyfile": str(settings.key_file)}


def unavailable_hint(settings: TlsSettings | None = None) -> str:
    """What to add to an UNAVAILABLE error a client saw: TLS is a likely cause either way."""
    settings = process_tls() if settings is None else settings
    if settings.connects_tls:
        return f" (TLS verified with the CA {settings.ca_file}: is it the server's CA?)"
    return " (connected without TLS: if the server uses TLS, pass its CA with --tls-ca)"
