"""CircuitBreaker (a hand-driven clock) and the metadata client's use of it: a replica that
accepts connections but never answers (what a SIGSTOPped process looks like) costs one short
read attempt, then is tried last."""

from __future__ import annotations

import time

import pytest

from kvflow.replication import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    MetadataGroup,
    NodeId,
    RemoteMetadata,
)
from tests.pausable_proxy import PausableProxy
from tests.replication.test_remote import served

assert served


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_probes_when_half_open() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=2, open_s=1.0, max_open_s=3.0), clock)
    assert b.allow() and not b.failure()
    b.success()  # resets the count
    assert not b.failure() and b.failure()  # two in a row: open
    assert b.state is BreakerState.OPEN and not b.allow() and b.opened == 1
    clock.now = 1.0
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # one probe at a time
    assert b.failure()  # the probe failed: open for twice as long
    clock.now = 2.9
    assert not b.allow()
    clock.now = 3.0
    assert b.allow() and b.failure()
    clock.now = 5.9  # capped at max_open_s = 3
    assert not b.allow()
    clock.now = 6.0
    assert b.allow()
    b.success()
    assert b.state is BreakerState.CLOSED and b.allow() and b.allow()
    assert b.trip() and not b.trip() and b.state is BreakerState.OPEN


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("failure_threshold", {"failure_threshold": 0}),
        ("open_s", {"open_s": 0.0}),
        ("open_s", {"open_s": float("nan")}),
        ("max_open_s", {"open_s": 2.0, "max_open_s": 1.0}),
    ],
)
def test_config_names_the_bad_field(field: str, kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=field):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]


def test_a_paused_replica_costs_one_short_read_attempt(
    served: tuple[MetadataGroup, str],
) -> None:
    """Before: a read waited the write's 6 s attempt timeout on the paused replica."""
    group, address = served
    group.register_node(NodeId("n1"), "x", "prefill", now=time.time())
    proxy = PausableProxy(address)  # the same replica, reached through a proxy we can pause
    try:
        with RemoteMetadata([proxy.address, address], timeout_s=10.0) as remote:
            assert [n.node for n in remote.view().nodes()] == ["n1"]  # via the proxy
            proxy.paused.set()
            t0 = time.monotonic()
            assert [n.node for n in remote.view().nodes()] == ["n1"]
            first = time.monotonic() - t0
            assert 0.3 < first < 1.5, first
            breakers = remote._endpoints.breakers
            assert breakers[proxy.address].state is BreakerState.OPEN
            t0 = time.monotonic()
            for _ in range(5):
                remote.view().nodes()
            assert time.monotonic() - t0 < 1.0
    finally:
        proxy.close()
