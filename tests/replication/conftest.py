"""Fixtures for the metadata group: configs on free loopback ports, groups closed at teardown."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvflow.replication import MetadataConfig, MetadataGroup
from kvflow.security import SECRET_FILE_ENV, generate_secret_file
from tests.conftest import pick_free_port
from tests.replication.procs import MetaCluster

FAST_RAFT = {
    "append_entries_period_s": 0.05,
    "raft_min_timeout_s": 0.25,
    "raft_max_timeout_s": 0.6,
    "connection_retry_s": 0.2,
    "commit_timeout_s": 5.0,
}


@pytest.fixture(scope="module", autouse=True)
def _cluster_secret(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test module here runs as one cluster: replica processes (which inherit the
    environment) and the test's own clients share this secret."""
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    generate_secret_file(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET_FILE_ENV, str(path))
        yield path


TEST_PASSWORD = "kvflow-test-group"
"""The in-process groups' password (a group with partners never runs open)."""


def make_config(
    address: str, partners: tuple[str, ...] = (), **overrides: object
) -> MetadataConfig:
    """A test config with short Raft timeouts."""
    fields: dict[str, object] = {**FAST_RAFT, "password": TEST_PASSWORD, **overrides}
    return MetadataConfig(self_address=address, partner_addresses=partners, **fields)  # type: ignore[arg-type]


def loopback_addresses(n: int) -> list[str]:
    return [f"127.0.0.1:{pick_free_port()}" for _ in range(n)]


GroupFactory = Callable[[MetadataConfig], MetadataGroup]


@pytest.fixture
def open_group() -> Iterator[GroupFactory]:
    """Start a MetadataGroup from a config; every group opened is closed at teardown."""
    opened: list[MetadataGroup] = []

    def factory(config: MetadataConfig) -> MetadataGroup:
        group = MetadataGroup(config)
        opened.append(group)
        group.start()
        return group

    yield factory
    for group in opened:
        group.close()


@pytest.fixture
def single_config(tmp_path: Path) -> MetadataConfig:
    """A single-replica config with its journal in tmp_path."""
    return make_config(f"127.0.0.1:{pick_free_port()}", journal_dir=tmp_path / "meta")


@pytest.fixture(autouse=True)
def _no_tick_threads_left() -> Iterator[None]:
    """Every test stops every metadata tick thread it started (fixtures close first)."""
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("kvflow-meta-")]
    assert alive == [], f"metadata tick threads still running: {alive}"


@pytest.fixture
def meta_cluster(tmp_path: Path) -> Iterator[Callable[[int], MetaCluster]]:
    """meta_cluster(n) -> a MetaCluster of n replica processes (not started); every process
    of every cluster made is killed at teardown, also when the test failed."""
    made: list[MetaCluster] = []

    def factory(n: int = 3) -> MetaCluster:
        cluster = MetaCluster(tmp_path / f"cluster-{len(made)}", n)
        cluster.root.mkdir(parents=True)
        made.append(cluster)
        return cluster

    yield factory
    for cluster in made:
        cluster.stop_all()


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetaCluster]:
    """3 replica processes started once for a test module, with an agreed leader."""
    cluster = MetaCluster(tmp_path_factory.mktemp("meta-cluster"), 3)
    try:
        cluster.start_all()
        cluster.leader_index()
        yield cluster
    finally:
        cluster.stop_all()
