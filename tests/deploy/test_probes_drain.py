"""The health probes and the router's drain on a real cluster started one role at a time
(`kvflow serve --role meta|node|router`, as the Kubernetes manifests start them) on 127.0.0.1:
every role answers ``/healthz`` and ``/readyz`` on its metrics port once it serves, and a
router told SIGTERM turns unready, refuses new requests with UNAVAILABLE (a client's cue to
use another router), lets the request in flight finish and exits 0."""

from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvflow.stages.api import pb2, pb2_grpc
from tests.faults.roles import HandStartedRoles, Role

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

SMALL = ["--block-size", "16", "--num-pages", "256", "--dram-mb", "32", "--ssd-mb", "64"]
LONG_ANSWER = 3500  # tokens: the request still runs when the router is told to stop


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def wait_probe(role: Role, port: int, path: str, want: int, timeout_s: float = 120.0) -> str:
    """Until ``path`` answers ``want``; the body. Fails with the last answer and the log."""
    deadline = time.monotonic() + timeout_s
    last: tuple[int, str] | str = "no answer"
    while time.monotonic() < deadline:
        assert role.proc is not None and role.proc.poll() is None, role.output()
        try:
            last = probe(port, path)
        except OSError as exc:
            last = repr(exc)
        if isinstance(last, tuple) and last[0] == want:
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"{role.name} {path}: {last!r} after {timeout_s}s:\n{role.output()}")


class Cluster(HandStartedRoles):
    def __init__(self, root: Path, model: Path) -> None:
        super().__init__(root, model, SMALL, ("--drain-s", "120"), router_http_port="0")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("probes"), tiny_model)
    try:
        for role in c.roles:  # each ready before the next starts, as Kubernetes orders them
            role.start()
            wait_probe(role, c.metrics[role.name], "/readyz", 200, timeout_s=240)
        yield c
    finally:
        for role in reversed(c.roles):
            role.stop()


def test_every_role_is_live_and_ready_on_its_metrics_port(cluster: Cluster) -> None:
    for role in cluster.roles:
        port = cluster.metrics[role.name]
        assert probe(port, "/healthz") == (200, "ok\n"), role.name
        assert probe(port, "/readyz") == (200, "ok\n"), role.name
        status, body = probe(port, "/metrics")
        assert status == 200 and "# TYPE" in body, role.name


def _request(max_tokens: int) -> pb2.GenerateRequest:
    req = pb2.GenerateRequest(max_tokens=max_tokens)
    req.token_ids.ids.extend(range(7, 30))
    req.sampling.ignore_eos = True
    return req


def test_sigterm_drains_the_router(cluster: Cluster) -> None:
    router = cluster.roles[-1]
    assert router.proc is not None
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router_port}")  # loopback: no keys
    stub = pb2_grpc.InferenceStub(channel)
    first_token = threading.Event()
    received: list[int] = []
    failure: list[BaseException] = []

    def stream() -> None:
        try:
            for msg in stub.Generate(_request(LONG_ANSWER), timeout=300):
                received.extend(msg.token_ids)
                first_token.set()
        except BaseException as exc:
            failure.append(exc)
            first_token.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        assert first_token.wait(timeout=120), router.output()
        assert not failure, failure
        router.proc.send_signal(signal.SIGTERM)
        port = cluster.metrics["router"]
        assert wait_probe(router, port, "/readyz", 503, timeout_s=60) == "draining\n"
        assert probe(port, "/healthz") == (200, "ok\n")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(_request(2), timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        assert "draining" in str(refused.value.details())
        still_running = reader.is_alive()
        reader.join(timeout=240)
        assert not reader.is_alive() and not failure, (failure, router.output())
        assert still_running, "the long request ended before the drain was checked"
        assert len(received) == LONG_ANSWER
        assert router.proc.wait(timeout=60) == 0, router.output()
        assert "kvflow: drained" in router.output()
    finally:
        channel.close()
