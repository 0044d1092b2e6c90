"""Real metadata replica processes on 127.0.0.1 (``python -m kvflow.tools.meta``) for tests.

:class:`MetaCluster` picks free ports, starts/kills/restarts replicas, and ``stop_all``
(called by the fixtures even when a test fails) kills every process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from kvflow.replication import RemoteMetadata
from kvflow.replication.wire import pb2, pb2_grpc
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_channel
from tests.conftest import pick_free_port

RAFT_ARGS = ("--raft-min-timeout-s", "0.3", "--raft-max-timeout-s", "0.8")
READY_S = 30.0


@dataclass
class Replica:
    meta_id: str
    raft: str
    grpc: str
    peers: tuple[str, ...]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)


class MetaCluster:
    """``n`` replicas whose journals live under ``root/data``; nothing started yet."""

    def __init__(self, root: Path, n: int = 3) -> None:
        self.root = root
        self.data_dir = root / "data"
        rafts = [f"127.0.0.1:{pick_free_port()}" for _ in range(n)]
        self.replicas = [
            Replica(
                meta_id=str(i),
                raft=raft,
                grpc=f"127.0.0.1:{pick_free_port()}",
                peers=tuple(r for r in rafts if r != raft),
                log_path=root / f"meta-{i}.log",
            )
            for i, raft in enumerate(rafts)
        ]

    @property
    def grpc_addresses(self) -> list[str]:
        return [r.grpc for r in self.replicas]

    def start(self, i: int) -> None:
        replica = self.replicas[i]
        assert replica.proc is None or replica.proc.poll() is not None, "already running"
        port = replica.grpc.rpartition(":")[2]
        replica.log = open(replica.log_path, "ab")  # noqa: SIM115 - closed in _reap
        replica.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvflow.tools.meta",
                "--log-level",
                "INFO",
                "--meta-id",
                replica.meta_id,
                "--address",
                replica.raft,
                "--peers",
                ",".join(replica.peers),
                "--grpc-port",
                port,
                "--data-dir",
                str(self.data_dir),
                *RAFT_ARGS,
            ],
            stdout=replica.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def start_all(self) -> None:
        for i in range(len(self.replicas)):
            self.start(i)

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` and wait for it to be gone."""
        replica = self.replicas[i]
        if replica.proc is not None and replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGKILL)
        self._reap(replica)

    def stop_all(self) -> None:
        """SIGTERM every live replica, SIGKILL what is left after 5 s."""
        for replica in self.replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            if replica.proc is not None:
                try:
                    replica.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    replica.proc.kill()
            self._reap(replica)

    def _reap(self, replica: Replica) -> None:
        if replica.proc is not None:
            replica.proc.wait(timeout=10)
        if replica.log is not None:
            replica.log.close()
            replica.log = None

    def client(self, indices: list[int] | None = None, timeout_s: float = 20.0) -> RemoteMetadata:
        picked = range(len(self.replicas)) if indices is None else indices
        client = RemoteMetadata([self.replicas[i].grpc for i in picked], timeout_s=timeout_s)
        client.start()
        return client

    def status(self, i: int, timeout: float = 2.0) -> object:
        """Replica ``i``'s StatusReply (raises grpc.RpcError when it does not answer)."""
        with cluster_channel(self.replicas[i].grpc, process_secret()) as channel:
            stub = pb2_grpc.MetadataServiceStub(channel)
            return stub.Status(pb2.StatusRequest(), timeout=timeout)

    def leader_index(self, among: list[int] | None = None, timeout: float = READY_S) -> int:
        """The index of the one replica that is leader and that every live replica in
        ``among`` agrees on; waits up to ``timeout``."""
        among = list(range(len(self.replicas))) if among is None else among
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                statuses = [self.status(i) for i in among]
            except grpc.RpcError:
                time.sleep(0.05)
                continue
            leaders = {s.leader for s in statuses}  # type: ignore[attr-defined]
            heads = [i for i, s in zip(among, statuses, strict=True) if s.is_leader]  # type: ignore[attr-defined]
            if len(heads) == 1 and leaders == {self.replicas[heads[0]].raft}:
                return heads[0]
            time.sleep(0.05)
        logs = "\n".join(
            r.log_path.read_text()[-2000:] for r in self.replicas if r.log_path.exists()
        )
        raise AssertionError(f"no agreed leader among {among} after {timeout}s\n{logs}")

    def journal_dir(self, i: int) -> Path:
        return self.data_dir / f"meta-{self.replicas[i].meta_id}"
