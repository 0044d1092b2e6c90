"""A hung holder (its connections open, nothing answered: a PausableProxy in front of its
BlockService and its transfer server) costs a read one deadline sized to the bytes, then its
breaker opens and reads skip it at once until the half-open probe; a read from a healthy
holder sharing the reader's transfer engine and breakers is not delayed meanwhile.

Before: a Lease to a paused holder waited its flat 5 s rpc_timeout_s on every read, and a
block read its transfer engine's 30 s request timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvflow.kvdb import (
    PeerBreakers,
    PeerCallBudget,
    RemoteClient,
    RemoteClientConfig,
    RemoteReadError,
    Tier,
)
from kvflow.replication import BreakerConfig, BreakerState
from kvflow.transfer import TransferEngine
from tests.kvdb.conftest import NBYTES, keys
from tests.kvdb.test_remote_read import TCP, Holder
from tests.pausable_proxy import PausableProxy

BUDGET = PeerCallBudget(
    base_s=0.3, breaker=BreakerConfig(failure_threshold=2, open_s=0.5, max_open_s=2.0)
)
PATIENT = PeerCallBudget(base_s=2.0, breaker=BUDGET.breaker)
SLACK_S = 0.7  # a shared 2-core machine; the transfer watchdog ticks every 0.1 s


class ProxiedHolder:
    """A Holder reached only through two proxies we can pause (control and transfer)."""

    def __init__(self, tmp_path: Path) -> None:
        self.holder = Holder(tmp_path)
        self.keys = self.holder.fill(4)
        self.control = PausableProxy(self.holder.address)
        self.data = PausableProxy(self.holder.transfer.peer_address)

    def pause(self, paused: bool = True) -> None:
        for proxy in (self.control, self.data):
            if paused:
                proxy.paused.set()
            else:
                proxy.paused.clear()

    def close(self) -> None:
        self.pause(False)
        self.control.close()
        self.data.close()
        self.holder.close()


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[ProxiedHolder]]:
    made = [ProxiedHolder(tmp_path / f"h{i}") for i in range(2)]
    yield made
    for h in made:
        h.close()


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    with TransferEngine(TCP) as e:
        yield e


def _client(h: ProxiedHolder, engine: TransferEngine, breakers: PeerBreakers) -> RemoteClient:
    return RemoteClient(
        h.control.address,
        engine,
        h.data.address,
        config=RemoteClientConfig(budget=breakers.budget),
        breaker=breakers.get(h.data.address),
    )


def _read(client: RemoteClient, keys: list[bytes]) -> tuple[float, list[Tier | None]]:
    bufs = [np.zeros(NBYTES, dtype=np.uint8) for _ in keys]
    t0 = time.monotonic()
    got = client.batch_get_into(keys, bufs)
    return time.monotonic() - t0, got


def test_a_paused_holder_costs_one_deadline_then_is_skipped_until_its_probe(
    holders: list[ProxiedHolder], engine: TransferEngine
) -> None:
    h = holders[0]
    breakers = PeerBreakers(BUDGET)
    with _client(h, engine, breakers) as client:
        assert _read(client, h.keys)[1] == [Tier.DRAM] * 4  # connections are up
        h.pause()
        deadline = BUDGET.deadline_s(4 * NBYTES)
        t0 = time.monotonic()
        with pytest.raises(RemoteReadError, match=r"Lease to .* failed"):
            client.batch_get_into(h.keys, [np.zeros(NBYTES, np.uint8) for _ in h.keys])
        took = time.monotonic() - t0
        assert deadline <= took + 0.05 and took < deadline + SLACK_S, took
        assert client.breaker.state is BreakerState.OPEN
        t0 = time.monotonic()
        with pytest.raises(RemoteReadError, match="circuit open"):
            _read(client, h.keys)
        assert time.monotonic() - t0 < 0.05
        assert client.stats().skipped == 1
        h.pause(False)
        time.sleep(BUDGET.breaker.open_s)  # half-open: the next read is the probe
        assert _read(client, h.keys)[1] == [Tier.DRAM] * 4
        assert client.breaker.state is BreakerState.CLOSED


def test_a_holder_that_hangs_after_the_lease_costs_the_read_deadline(
    holders: list[ProxiedHolder], engine: TransferEngine
) -> None:
    """The Lease answers; the transfer server does not: the read ends at its deadline with
    misses (then recomputed) and the breaker opens."""
    h = holders[0]
    with _client(h, engine, PeerBreakers(BUDGET)) as client:
        assert _read(client, h.keys)[1] == [Tier.DRAM] * 4
        h.data.paused.set()
        took, got = _read(client, h.keys)
        assert got == [None] * 4
        assert took < BUDGET.deadline_s(4 * NBYTES) + SLACK_S, took
        assert client.breaker.state is BreakerState.OPEN


def test_a_paused_holder_does_not_delay_reads_from_a_healthy_one(
    holders: list[ProxiedHolder], engine: TransferEngine
) -> None:
    """One transfer engine and one PeerBreakers for both holders, as in a node. Deadlines of
    2 s here, not 0.3: on a loaded machine a healthy Lease once took longer than 0.3 s (its
    server's thread starved), which is not what this test is about; against a 2 s hang a
    healthy read that waited for it would take 2 s, and one that did not takes milliseconds."""
    breakers = PeerBreakers(PATIENT)
    paused, healthy = holders
    with _client(paused, engine, breakers) as slow, _client(healthy, engine, breakers) as fast:
        assert _read(slow, paused.keys)[1] == [Tier.DRAM] * 4
        assert _read(fast, healthy.keys)[1] == [Tier.DRAM] * 4
        paused.pause()
        errors: list[BaseException] = []

        def hung_read() -> None:
            try:
                _read(slow, paused.keys)
            except RemoteReadError as exc:
                errors.append(exc)

        t = threading.Thread(target=hung_read)
        t.start()
        times = []
        while t.is_alive():  # every read from the healthy holder while the other one hangs
            took, got = _read(fast, healthy.keys)
            assert got == [Tier.DRAM] * 4
            times.append(took)
        t.join()
        assert len(errors) == 1 and len(times) >= 2
        assert max(times) < 1.0, times  # a healthy read is a few ms; the hang lasts 2 s+
        assert breakers.get(healthy.data.address).state is BreakerState.CLOSED
        assert breakers.get(paused.data.address).state is BreakerState.OPEN


def test_budget_sizes_deadlines_to_bytes_and_validates() -> None:
    b = PeerCallBudget(base_s=0.5, bytes_per_s=1e6, ceiling_s=3.0)
    assert b.deadline_s(0) == 0.5
    assert b.deadline_s(1_000_000) == pytest.approx(1.5)
    assert b.deadline_s(10_000_000) == 3.0  # the ceiling
    with pytest.raises(ValueError, match="nbytes"):
        b.deadline_s(-1)
    for name in ("base_s", "bytes_per_s", "ceiling_s"):
        with pytest.raises(ValueError, match=name):
            PeerCallBudget(**{name: 0})
        with pytest.raises(ValueError, match=name):
            PeerCallBudget(**{name: float("nan")})
    with pytest.raises(ValueError, match="ceiling_s"):
        PeerCallBudget(base_s=2.0, ceiling_s=1.0)
    assert b.last_resort_s == 5.0  # the default
    assert b.patient_deadline_s(0, 0.0) == 0.5  # no patience: the plain deadline
    assert b.patient_deadline_s(0, 2.0) == 2.0
    assert b.patient_deadline_s(2_000_000, 2.0) == pytest.approx(2.5)  # the bytes' is longer
    assert b.patient_deadline_s(0, 9.0) == 3.0  # the ceiling
    with pytest.raises(ValueError, match="patience_s"):
        b.patient_deadline_s(0, -1.0)
    for bad in (0, float("inf")):
        with pytest.raises(ValueError, match="last_resort_s"):
            PeerCallBudget(last_resort_s=bad)
    breakers = PeerBreakers(b)
    assert breakers.get("a") is breakers.get("a") and breakers.get("a") is not breakers.get("b")
    breakers.get("a").trip()
    assert breakers.opened() == {"a": 1, "b": 0}


def test_a_half_open_probe_that_finds_no_blocks_still_closes_the_breaker(
    holders: list[ProxiedHolder], engine: TransferEngine
) -> None:
    """The probe's Lease answers with nothing to read: the breaker must not stay half-open
    with its probe outstanding (every later read would be refused)."""
    h = holders[0]
    with _client(h, engine, PeerBreakers(BUDGET)) as client:
        client.breaker.trip()
        time.sleep(BUDGET.breaker.open_s)
        assert _read(client, keys(8, tenant="tenant-b")[:2])[1] == [None, None]
        assert client.breaker.state is BreakerState.CLOSED
        assert _read(client, h.keys)[1] == [Tier.DRAM] * 4


def test_a_last_resort_read_waits_out_a_holder_that_answers_late_despite_its_open_breaker(
    holders: list[ProxiedHolder], engine: TransferEngine
) -> None:
    """The holder is paused a little longer than base_s: the plain read times out (it says
    so: ``timed_out``) and opens the breaker; a read with ``patience_s`` is not skipped for
    that, and gets the blocks once a timer resumes the holder. Paused for good, the patient
    read costs its patience and says it timed out."""
    h = holders[0]
    breakers = PeerBreakers(BUDGET)
    patience_s = 3.0
    with _client(h, engine, breakers) as client:
        assert _read(client, h.keys)[1] == [Tier.DRAM] * 4  # connections are up
        h.pause()
        resume = threading.Timer(BUDGET.base_s + 0.5, h.pause, (False,))
        resume.start()
        try:
            with pytest.raises(RemoteReadError) as plain:
                _read(client, h.keys)
            assert plain.value.timed_out and not plain.value.skipped
            assert client.breaker.state is BreakerState.OPEN
            with pytest.raises(RemoteReadError) as skipped:
                _read(client, h.keys)  # the breaker skips a plain read
            assert skipped.value.skipped and not skipped.value.timed_out
            bufs = [np.zeros(NBYTES, dtype=np.uint8) for _ in h.keys]
            t0 = time.monotonic()
            assert client.batch_get_into(h.keys, bufs, patience_s=patience_s) == [Tier.DRAM] * 4
            assert time.monotonic() - t0 < patience_s
            assert client.breaker.state is BreakerState.CLOSED  # it answered
        finally:
            resume.cancel()
            resume.join()
        client.wait_released()
        h.pause()
        t0 = time.monotonic()
        with pytest.raises(RemoteReadError) as late:
            client.batch_get_into(h.keys, bufs, patience_s=patience_s)
        took = time.monotonic() - t0
        assert late.value.timed_out
        assert patience_s - 0.05 <= took < patience_s + SLACK_S, took
