"""A cluster started one role at a time (`kvflow serve --role meta|node|router`) on 127.0.0.1
with no secret flag, as issue 25 found it open: every role shares the secret the first one
generated in the common data dir, the pickle probe on every port of every role runs no code,
and the transfer port gives nothing to a READ without the secret (it gave the node's memory
before)."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.security import load_secret_file
from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.transfer import TransferConfig, TransferEngine

from ..security.pickle_attack import send_pickle
from .roles import HandStartedRoles

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.cluster]

SMALL = ["--block-size", "16", "--num-pages", "128", "--dram-mb", "32", "--ssd-mb", "64"]


class HandCluster(HandStartedRoles):
    def __init__(self, root: Path, model: Path) -> None:
        super().__init__(root, model, SMALL)

    @property
    def secret_file(self) -> Path:
        return self.data_dir / "cluster.secret"

    def transfer_address(self) -> str:
        match = re.search(r"transfer (\S+?:\d+)", self.roles[1].output())
        assert match, self.roles[1].output()
        return match.group(1)


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[HandCluster]:
    cluster = HandCluster(tmp_path_factory.mktemp("hand"), tiny_model)
    ready = {"meta": "kvflow meta", "prefill": "kvflow node", "decode": "kvflow node"}
    try:
        for role in cluster.roles:
            role.start()
            role.wait_for(ready.get(role.name, "kvflow router on"), timeout_s=240)
        yield cluster
    finally:
        for role in reversed(cluster.roles):
            role.stop()


def test_every_role_uses_the_one_generated_secret(hand: HandCluster) -> None:
    logs = [role.output() for role in hand.roles]
    assert "generated the cluster secret" in logs[0]
    for log in logs[1:]:
        assert f"cluster secret: {hand.secret_file.resolve()} (data dir)" in log
    req = pb2.GenerateRequest(max_tokens=2)
    req.token_ids.ids.extend(range(7, 30))
    with InferenceClient([f"127.0.0.1:{hand.router_port}"]) as client:  # loopback: no keys
        tokens = [t for m in client.generate(req, timeout=120) for t in m.token_ids]
    assert len(tokens) == 2


def test_the_pickle_probe_runs_no_code_on_any_port(hand: HandCluster, tmp_path: Path) -> None:
    ports: set[int] = set()
    for role in hand.roles:
        ports |= role.listening_ports()
    assert len(ports) >= 11  # meta 3, nodes 4 each (gRPC, transfer, metrics...), router 3
    for port in sorted(ports):
        send_pickle(f"127.0.0.1:{port}", tmp_path / f"pwned-{port}", wait_s=0.4)
    time.sleep(1.0)
    assert not list(tmp_path.glob("pwned-*"))
    assert all(role.proc is not None and role.proc.poll() is None for role in hand.roles)


def test_a_transfer_read_without_the_secret_gets_nothing(hand: HandCluster) -> None:
    transfer = hand.transfer_address()
    host, _, port = transfer.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"\x00" * 4096)  # a READ header and more, with no handshake answer
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except ConnectionResetError:  # closed with our unread bytes still queued
            pass
    assert received.startswith(b"KVFH1") and len(received) == 37  # the challenge only
    key = load_secret_file(hand.secret_file).transfer_key()
    for secret, opens in ((None, False), (b"\x01" * 32, False), (key, True)):
        config = TransferConfig(secret=secret, prefer_shm=False, connect_timeout_s=2.0)
        with TransferEngine(config) as engine:
            try:
                engine.open_segment(transfer, "prefill-0/pool")
                opened = True
            except Exception:
                opened = False
        assert opened == opens, secret
