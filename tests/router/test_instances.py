"""InstanceState: queue accounting, decode batch, errors."""

from __future__ import annotations

import threading

import pytest

from kvflow.router import InstanceKind, InstanceState, UnknownInstanceError


def test_queue_sums_and_started_work_shrinks():
    s = InstanceState("p", InstanceKind.PREFILL)
    s.enqueue("a", 1.0)
    s.enqueue("b", 0.5)
    s.start("a", now=100.0)
    assert s.queued_seconds() == pytest.approx(1.5)
    assert s.queued_seconds(now=100.25) == pytest.approx(1.25)
    assert s.queued_seconds(now=200.0) == pytest.approx(0.5)
    s.finish("a")
    assert (s.queued_requests, s.queued_seconds()) == (1, 0.5)


def test_bad_calls_raise_and_change_nothing():
    s = InstanceState("p", "prefill")
    s.enqueue("a", 1.0)
    with pytest.raises(ValueError, match="already queued"):
        s.enqueue("a", 2.0)
    with pytest.raises(ValueError, match="predicted_s"):
        s.enqueue("b", -1.0)
    with pytest.raises(UnknownInstanceError):
        s.finish("zzz")
    with pytest.raises(UnknownInstanceError):
        s.start("zzz", 0.0)
    assert (s.queued_requests, s.queued_seconds()) == (1, 1.0)


def test_decode_batch():
    s = InstanceState("d", InstanceKind.DECODE)
    s.add_decode("a", 100)
    s.add_decode("b", 50)
    s.grow_decode("a", 3)
    snap = s.snapshot()
    assert (snap.decode_batch_size, snap.decode_context_tokens) == (2, 153)
    s.remove_decode("b")
    with pytest.raises(UnknownInstanceError):
        s.remove_decode("b")
    assert s.decode_context_tokens == 103


def test_concurrent_enqueue_finish():
    s = InstanceState("p", InstanceKind.PREFILL)

    def worker(t: int) -> None:
        for i in range(200):
            s.enqueue(f"{t}-{i}", 0.001)
            s.finish(f"{t}-{i}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert (s.queued_requests, s.queued_seconds()) == (0, 0.0)


def test_reported_load_adds_what_other_routers_booked():
    s = InstanceState("p", "prefill")
    s.enqueue("mine", 1.0)
    s.add_decode("d", 10)
    # The instance reports 3 s queued, 4 decoding with 100 context tokens: of which this
    # router booked 1 s and one request of 10 tokens.
    s.set_reported_load(3.0, 4, 100)
    assert s.external_load == (2.0, 3, 90)
    snap = s.snapshot()
    assert (snap.queued_seconds, snap.decode_batch_size, snap.decode_context_tokens) == (
        3.0,
        4,
        100,
    )
    s.finish("mine")  # this router's own work leaves at once; the external part stays
    assert s.snapshot().queued_seconds == 2.0
    s.set_reported_load(0.5, 0, 0)  # a report below our books: no external load
    assert s.external_load == (0.5, 0, 0)
    s.enqueue("again", 2.0)
    s.set_reported_load(1.0, 0, 0)
    assert s.external_load == (0.0, 0, 0) and s.snapshot().queued_seconds == 2.0
    for bad in ((-1.0, 0, 0), (float("nan"), 0, 0), (0.0, -1, 0)):
        with pytest.raises(ValueError):
            s.set_reported_load(*bad)
    assert s.external_load == (0.0, 0, 0)


def test_unlocked_state_matches_locked_op_for_op():
    """The simulator's lock-free variant: same terms, snapshots, change notices and errors."""
    from kvflow.router.instances import ChangeSet, UnlockedInstanceState

    pairs = [
        (InstanceState(f"{k}", k), UnlockedInstanceState(f"{k}", k)) for k in ("prefill", "decode")
    ]
    changed = [ChangeSet(), ChangeSet()]
    for locked, unlocked in pairs:
        locked.watch(changed[0])
        unlocked.watch(changed[1])

    def both(state_pair, op, *args):
        results = []
        for state in state_pair:
            try:
                getattr(state, op)(*args)
                results.append(None)
            except Exception as e:  # compared below
                results.append((type(e), str(e)))
        assert results[0] == results[1], (op, args)
        assert [s.instance_id for s in changed[0]] == [s.instance_id for s in changed[1]]
        changed[0].clear()
        changed[1].clear()
        assert state_pair[0].load_terms() == state_pair[1].load_terms()
        for now in (None, 10.5, 99.0):
            assert state_pair[0].snapshot(now) == state_pair[1].snapshot(now)

    prefill, decode = pairs
    for op, args in [
        ("enqueue", ("a", 1.0)), ("enqueue", ("b", 0.5)), ("enqueue", ("a", 2.0)),
        ("enqueue", ("c", -1.0)), ("start", ("a", 10.0)), ("start", ("zz", 10.0)),
        ("start", ("a", 11.0)), ("finish", ("b",)), ("finish", ("b",)), ("finish", ("a",)),
    ]:  # fmt: skip
        both(prefill, op, *args)
    for op, args in [
        ("add_decode", ("x", 100)), ("add_decode", ("x", 5)), ("add_decode", ("y", -1)),
        ("add_decode", ("y", 7)), ("remove_decode", ("x",)), ("remove_decode", ("x",)),
    ]:  # fmt: skip
        both(decode, op, *args)
