"""TLS under the cluster token on real gRPC servers (sync and aio): a client with the CA and
the secret gets through; without the CA, with another CA, or without the secret it does not;
a TLS port never speaks plaintext."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc import aio

from kvflow.security import ClusterSecret
from kvflow.security.certs import LocalCertFiles, generate_local_certs
from kvflow.security.grpc_auth import (
    aio_cluster_interceptors,
    cluster_aio_channel,
    cluster_channel,
    cluster_interceptors,
)
from kvflow.security.tls import PLAINTEXT, TlsSettings, add_port, unavailable_hint

from .test_grpc_auth import KINDS, handlers, sync_call

SECRET = ClusterSecret(b"s" * 32)


def refusal(channel: grpc.Channel) -> grpc.RpcError:
    """The error of one unary call on ``channel`` (which must fail)."""
    with channel, pytest.raises(grpc.RpcError) as info:
        sync_call(channel, "UU")
    return info.value


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> LocalCertFiles:
    return generate_local_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_local_certs(tmp_path_factory.mktemp("other")).ca_file


@pytest.fixture
def tls_server(certs: LocalCertFiles) -> Iterator[tuple[int, list[str]]]:
    calls: list[str] = []
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=cluster_interceptors(SECRET))
    server.add_generic_rpc_handlers((handlers(calls, is_aio=False),))
    port = add_port(server, "127.0.0.1:0", TlsSettings(certs.cert_file, certs.key_file))
    server.start()
    try:
        yield port, calls
    finally:
        server.stop(0)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_tls_client_with_the_ca_and_the_secret_gets_through(tls_server, certs, host) -> None:
    port, calls = tls_server
    with cluster_channel(f"{host}:{port}", SECRET, (), TlsSettings(ca_file=certs.ca_file)) as ch:
        for kind in KINDS:
            assert sync_call(ch, kind) == b"x"
    assert calls == list(KINDS)


def test_tls_without_the_secret_is_still_unauthenticated(tls_server, certs) -> None:
    port, calls = tls_server
    tls = TlsSettings(ca_file=certs.ca_file)
    error = refusal(cluster_channel(f"127.0.0.1:{port}", None, (), tls))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert calls == []


def test_plaintext_client_to_a_tls_port_is_unavailable(tls_server) -> None:
    port, calls = tls_server
    error = refusal(cluster_channel(f"127.0.0.1:{port}", SECRET, (), PLAINTEXT))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert calls == []
    assert "--tls-ca" in unavailable_hint(PLAINTEXT)


def test_client_with_another_ca_is_unavailable(tls_server, other_ca) -> None:
    port, calls = tls_server
    error = refusal(cluster_channel(f"127.0.0.1:{port}", SECRET, (), TlsSettings(ca_file=other_ca)))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (error.details() or "")
    assert calls == []


def test_tls_client_to_a_plaintext_port_is_unavailable(certs) -> None:
    calls: list[str] = []
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=cluster_interceptors(SECRET))
    server.add_generic_rpc_handlers((handlers(calls, is_aio=False),))
    port = add_port(server, "127.0.0.1:0", PLAINTEXT)
    server.start()
    try:
        tls = TlsSettings(ca_file=certs.ca_file)
        error = refusal(cluster_channel(f"127.0.0.1:{port}", SECRET, (), tls))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert calls == []
    finally:
        server.stop(0)


def test_aio_server_and_channel_over_tls(certs) -> None:
    async def main() -> tuple[list[bytes], grpc.StatusCode]:
        calls: list[str] = []
        server = aio.server(interceptors=aio_cluster_interceptors(SECRET))
        server.add_generic_rpc_handlers((handlers(calls, is_aio=True),))
        port = add_port(server, "127.0.0.1:0", TlsSettings(certs.cert_file, certs.key_file))
        await server.start()
        try:
            tls = TlsSettings(ca_file=certs.ca_file)
            async with cluster_aio_channel(f"127.0.0.1:{port}", SECRET, (), tls) as ch:
                ok = [await ch.unary_unary("/t.T/UU")(b"x", timeout=5)]
                ok += [r async for r in ch.unary_stream("/t.T/US")(b"x", timeout=5)]
            async with cluster_aio_channel(f"127.0.0.1:{port}", SECRET, (), PLAINTEXT) as ch:
                try:
                    await ch.unary_unary("/t.T/UU")(b"x", timeout=5)
                except grpc.RpcError as err:
                    refused = err.code()
            return ok, refused
        finally:
            await server.stop(0)

    ok, refused = asyncio.run(main())
    assert ok == [b"x", b"x"]
    assert refused == grpc.StatusCode.UNAVAILABLE
