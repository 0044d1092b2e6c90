"""Fixtures for the metadata group: configs on free loopback ports, groups closed at teardown."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvflow.replication import MetadataConfig, MetadataGroup
from tests.conftest import pick_free_port

FAST_RAFT = {
    "append_entries_period_s": 0.05,
    "raft_min_timeout_s": 0.25,
    "raft_max_timeout_s": 0.6,
    "connection_retry_s": 0.2,
    "commit_timeout_s": 5.0,
}


def make_config(
    address: str, partners: tuple[str, ...] = (), **overrides: object
) -> MetadataConfig:
    """A test config with short Raft timeouts."""
    fields: dict[str, object] = {**FAST_RAFT, **overrides}
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
