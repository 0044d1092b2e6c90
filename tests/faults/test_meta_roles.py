"""Three metadata replicas started one by one (`kvflow serve --role meta`) on 127.0.0.1 with
no secret flag, as issue 25 found them: the pickle probe on every port they listen on runs no
code, the secret they generated is one 0600 file they share and reuse, and a flood of
unauthenticated bytes on a Raft port neither grows the replica's memory nor stops node
heartbeats. Every check here failed on the code before (3 of 3 replicas ran the pickle;
84 MiB sent grew a replica by 125-150 MB)."""

from __future__ import annotations

import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvflow.replication import NodeId, RemoteMetadata
from kvflow.replication.raft_gate import HANDSHAKE_DEADLINE_S
from kvflow.security import SECRET_FILE_ENV
from tests.conftest import pick_free_port

from ..security.pickle_attack import send_pickle
from .roles import Role

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.cluster]

FLOOD_BYTES = 84 << 20
FLOOD_MIN_S = 4.0
RSS_SLACK = 32 << 20


class Metas:
    def __init__(self, root: Path) -> None:
        self.data_dir = root / "data"
        self.rafts = [f"127.0.0.1:{pick_free_port()}" for _ in range(3)]
        self.grpcs = [f"127.0.0.1:{pick_free_port()}" for _ in range(3)]
        self.roles = [
            Role(
                f"meta-{i}",
                [
                    "--role", "meta", "--meta-id", str(i), "--address", raft,
                    "--peers", ",".join(r for r in self.rafts if r != raft),
                    "--grpc-port", self.grpcs[i].rpartition(":")[2],
                    "--metrics-port", str(pick_free_port()),
                    "--data-dir", str(self.data_dir),
                    "--raft-min-timeout-s", "0.3", "--raft-max-timeout-s", "0.8",
                ],
                root / f"meta-{i}.log",
            )
            for i, raft in enumerate(self.rafts)
        ]  # fmt: skip

    @property
    def secret_file(self) -> Path:
        return self.data_dir / "cluster.secret"


@pytest.fixture(scope="module")
def metas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Metas]:
    group = Metas(tmp_path_factory.mktemp("metas"))
    try:
        for role in group.roles:  # one by one, as on three hosts
            role.start()
            role.wait_for("kvflow meta")
        yield group
    finally:
        for role in group.roles:
            role.stop()


@pytest.fixture
def client(metas: Metas, monkeypatch: pytest.MonkeyPatch) -> Iterator[RemoteMetadata]:
    monkeypatch.setenv(SECRET_FILE_ENV, str(metas.secret_file))
    with RemoteMetadata(metas.grpcs, timeout_s=30.0) as meta:
        meta.wait_ready(60.0)
        yield meta


def test_they_share_one_private_generated_secret_and_form_a_group(metas, client) -> None:
    assert stat.S_IMODE(metas.secret_file.stat().st_mode) == 0o600
    logs = "".join(role.output() for role in metas.roles)
    assert f"generated the cluster secret {metas.secret_file.resolve()}" in logs
    assert logs.count("generated the cluster secret") == 1  # the others reused it
    client.register_node(NodeId("n-probe"), "127.0.0.1:1|127.0.0.1:2", "prefill")
    assert "n-probe" in {n.node for n in client.view().nodes()}


def test_the_pickle_probe_runs_no_code_on_any_port(metas, client, tmp_path: Path) -> None:
    ports = set()
    for role in metas.roles:
        ports |= role.listening_ports()
    assert len(ports) >= 9  # Raft, gRPC and metrics of each
    for port in sorted(ports):
        marker = tmp_path / f"pwned-{port}"
        send_pickle(f"127.0.0.1:{port}", marker, wait_s=0.4)
    time.sleep(1.0)
    assert not list(tmp_path.glob("pwned-*"))
    assert all(role.proc is not None and role.proc.poll() is None for role in metas.roles)
    assert client.heartbeat(NodeId("n-probe")) in (True, False)  # the group still answers


def _flood(address: str, total: int, stop: threading.Event) -> int:
    """Send at least ``total`` bytes of frames declaring 64 MiB, for at least
    ``FLOOD_MIN_S``, reconnecting whenever the replica closes the connection."""
    host, _, port = address.rpartition(":")
    chunk = struct.pack("i", 64 << 20) + b"\x5a" * (1 << 20)
    sent = 0
    until = time.monotonic() + FLOOD_MIN_S
    while (sent < total or time.monotonic() < until) and not stop.is_set():
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                while sent < total or time.monotonic() < until:
                    sock.sendall(chunk)
                    sent += len(chunk)
        except OSError:
            time.sleep(0.01)
    return sent


def test_a_pre_auth_flood_keeps_memory_bounded_and_heartbeats_alive(metas, client) -> None:
    target = metas.roles[0]
    assert target.proc is not None
    proc = psutil.Process(target.proc.pid)
    before = proc.memory_info().rss
    node = NodeId("n-beat")
    client.register_node(node, "127.0.0.1:1|127.0.0.1:2", "decode")
    stop = threading.Event()
    failures: list[BaseException] = []
    beats = 0

    def beat() -> None:
        nonlocal beats
        while not stop.is_set():
            try:
                client.heartbeat(node)
                beats += 1
            except Exception as exc:
                failures.append(exc)
            stop.wait(0.2)

    beater = threading.Thread(target=beat)
    beater.start()
    peak = before
    flooders = [
        threading.Thread(target=_flood, args=(metas.rafts[0], FLOOD_BYTES // 4, stop))
        for _ in range(4)
    ]
    try:
        for t in flooders:
            t.start()
        while any(t.is_alive() for t in flooders):
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.05)
    finally:
        stop.set()
        for t in flooders:
            t.join(60)
        beater.join(30)
    assert peak - before < RSS_SLACK, f"RSS grew {(peak - before) >> 20} MiB"
    assert not failures, failures[:3]
    assert beats >= 5  # every 0.2 s while the flood ran
    assert client.heartbeat(node)


def test_a_silent_connection_is_closed_after_the_handshake_deadline(metas) -> None:
    host, _, port = metas.rafts[1].rpartition(":")
    with socket.create_connection((host, int(port)), timeout=HANDSHAKE_DEADLINE_S + 20) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the replica, not by our timeout
        assert time.monotonic() - started < HANDSHAKE_DEADLINE_S + 15


def test_a_restarted_replica_reuses_the_secret(metas, client) -> None:
    value = metas.secret_file.read_bytes()
    role = metas.roles[2]
    role.stop()
    role.log_path = role.log_path.with_name("meta-2-restarted.log")
    role.start()
    role.wait_for("kvflow meta 2: raft", timeout_s=120)
    assert metas.secret_file.read_bytes() == value
    assert f"cluster secret: {metas.secret_file.resolve()} (data dir)" in role.output()
    client.register_node(NodeId("n-after"), "127.0.0.1:1|127.0.0.1:2", "prefill")
    assert "n-after" in {n.node for n in client.view().nodes()}
