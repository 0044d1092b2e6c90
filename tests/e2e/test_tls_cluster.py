"""A real cluster with TLS on every port (``LocalCluster(tls=True)``, the code behind
``kvflow cluster --tls``; 1 metadata replica, 1 prefill, 1 decode node, 1 router on
127.0.0.1): a request through the router works (router -> nodes -> metadata all over TLS),
over gRPC, HTTPS and ``kvflow generate --tls-ca``; a plaintext client and a client that
trusts another CA are refused (UNAVAILABLE), at the router and at a node."""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvflow.security.certs import generate_local_certs
from kvflow.security.grpc_auth import cluster_channel
from kvflow.security.tls import ENV_NAMES, PLAINTEXT, TlsSettings
from kvflow.stages.api import node_pb2, node_pb2_grpc, pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.tools import cli
from kvflow.tools.supervise import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

IDS = list(range(5, 45))


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(
        tmp_path_factory.mktemp("tls-cluster"),
        meta=1,
        prefill=1,
        decode=1,
        model=tiny_model,
        tls=True,
        extra=("--block-size", "16", "--num-pages", "128", "--dram-mb", "32"),
    )
    try:
        c.start(timeout_s=90)
        yield c
    finally:
        c.stop()


def generate(cluster: LocalCluster, tls: TlsSettings) -> list[int]:
    req = pb2.GenerateRequest(max_tokens=4)
    req.sampling.ignore_eos = True
    req.token_ids.ids.extend(IDS)
    with InferenceClient(cluster.addresses, max_attempts=1, tls=tls) as client:
        return [t for msg in client.generate(req, timeout=60) for t in msg.token_ids]


def test_a_request_through_the_router_over_tls(cluster: LocalCluster) -> None:
    assert cluster.client_tls.ca_file is not None
    assert len(generate(cluster, cluster.client_tls)) == 4


def test_https_front(cluster: LocalCluster) -> None:
    assert cluster.http_urls[0].startswith("https://")
    context = ssl.create_default_context(cafile=str(cluster.client_tls.ca_file))
    conn = http.client.HTTPSConnection("127.0.0.1", cluster.http_ports[0], context=context)
    try:
        body = {"model": "tiny", "prompt": IDS, "max_tokens": 2, "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "x/json"})
        doc = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    assert doc["usage"]["completion_tokens"] == 2


def test_kvflow_generate_with_tls_ca(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ENV_NAMES:  # --tls-ca sets the process's variables: undo it afterwards
        monkeypatch.setenv(name, "")
    ids = ",".join(map(str, IDS))
    argv = ["generate", "--server", cluster.address, "--token-ids", ids, "--max-tokens", "2"]
    code = cli.main([*argv, "--json", "--ignore-eos", "--tls-ca", str(cluster.client_tls.ca_file)])
    assert code == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


def test_plaintext_client_is_refused(cluster: LocalCluster) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(cluster, PLAINTEXT)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_trusting_another_ca_is_refused(cluster: LocalCluster, tmp_path: Path) -> None:
    other = TlsSettings(ca_file=generate_local_certs(tmp_path).ca_file)
    with pytest.raises(grpc.RpcError) as info:
        generate(cluster, other)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CERTIFICATE_VERIFY_FAILED" in (info.value.details() or "")


@pytest.mark.parametrize("tls", ["plaintext", "cluster-ca"])
def test_node_port_needs_tls_even_with_the_secret(cluster: LocalCluster, tls: str) -> None:
    settings = PLAINTEXT if tls == "plaintext" else cluster.client_tls
    address = f"127.0.0.1:{cluster.node_ports['prefill-0']}"
    with cluster_channel(address, cluster.secret, (), settings) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        call = stub.Release
        if tls == "plaintext":
            with pytest.raises(grpc.RpcError) as info:
                call(node_pb2.ReleaseRequest(lease_id="none"), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        else:  # the positive control: TLS and the secret reach the servicer
            call(node_pb2.ReleaseRequest(lease_id="none"), timeout=5)
