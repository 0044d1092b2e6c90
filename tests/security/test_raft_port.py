"""The Raft port: bound to the configured host only, and nothing reaches pickle.loads without
the password (both fail on the old code: pysyncobj bound 0.0.0.0 and had no password)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.replication import MetadataConfig, MetadataGroup
from kvflow.tools.args import free_port

from .pickle_attack import send_pickle


@pytest.fixture
def replica() -> Iterator[MetadataGroup]:
    group = MetadataGroup(MetadataConfig(self_address=f"127.0.0.1:{free_port()}"))
    group.start()
    group.wait_ready(10.0)
    try:
        yield group
    finally:
        group.close()


def test_a_pickle_sent_to_the_raft_port_never_runs(replica, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    send_pickle(replica.config.self_address, marker)
    assert not marker.exists()
    assert replica.is_leader()  # and the replica still works


def test_the_raft_port_binds_the_configured_host_only(replica) -> None:
    port = int(replica.config.self_address.rpartition(":")[2])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2):
        pass
