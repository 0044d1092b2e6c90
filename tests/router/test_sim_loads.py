"""The simulator's own load arrays (SimLoads) against a LoadTable over InstanceStates given the
same mutations: every array bit for bit, op for op, on seeded random sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvflow.router import (
    Conductor,
    DecodeTimeModel,
    InstanceKind,
    InstanceState,
    LocalPrefixIndex,
    PrefillTimeModel,
    RouteDecision,
    RouterConfig,
    RouteRequest,
    TransferEstimator,
)
from kvflow.router.load_table import MANY_RUNNING, LoadArrays, LoadTable
from kvflow.router.reference import ReferenceConductor
from kvflow.router.sim_loads import SimLoads
from tests.interpreted import interpreted

PREFILL = PrefillTimeModel((2e-3, 1e-4, 3e-9, 2e-6), "sim-loads")
DECODE = DecodeTimeModel((1e-2, 1e-4, 2e-8), "sim-loads")


_ARRAYS = slice(2, 6)  # LoadArrays' four columns


def _same(a: LoadArrays, b: LoadArrays) -> bool:
    if a.instance_ids != b.instance_ids or a.positions != b.positions:
        return False
    return all(
        x.dtype == y.dtype and x.tobytes() == y.tobytes()
        for x, y in zip(a[_ARRAYS], b[_ARRAYS], strict=True)
    )


def _groups_of(load: LoadArrays) -> dict[tuple[int, int], list[int]]:
    """The decode groups a load's arrays describe (positions ascending)."""
    groups: dict[tuple[int, int], list[int]] = {}
    pairs = zip(load.decode_batch_size.tolist(), load.decode_context_tokens.tolist(), strict=True)
    for at, state in enumerate(pairs):
        groups.setdefault(state, []).append(at)
    return groups


def _bytes(pb: LoadArrays, db: LoadArrays) -> bytes:
    return b"".join(a.tobytes() for a in (*pb[_ARRAYS], *db[_ARRAYS]))


def _diverges(
    book: SimLoads,
    seed: int,
    n: int = 24,
    m: int = 8,
    ops: int = 1500,
    peak: list[int] | None = None,
) -> int | None:
    """Apply one random op sequence to ``book`` and to InstanceStates read by LoadTables; the
    first op after which a read differs (None if none does). ``peak`` collects how many rows
    had running requests at each read."""
    rng = random.Random(seed)
    prefill = tuple(InstanceState(f"prefill-{i}", InstanceKind.PREFILL) for i in range(n))
    decode = tuple(InstanceState(f"decode-{i}", InstanceKind.DECODE) for i in range(m))
    ptable, dtable = (
        LoadTable(prefill, InstanceKind.PREFILL),
        LoadTable(decode, InstanceKind.DECODE),
    )
    queued: list[list[str]] = [[] for _ in range(n)]  # request ids, in enqueue order
    started: list[set[str]] = [set() for _ in range(n)]
    decoding: list[list[str]] = [[] for _ in range(m)]
    now = 0.0
    handed_out: list[tuple[LoadArrays, LoadArrays, bytes]] = []
    for op in range(ops):
        now += rng.choice((0.0, rng.random() * 0.05))
        kind = rng.random()
        at = rng.randrange(n)
        if kind < 0.35:
            rid = f"r{op}"
            predicted = rng.choice((0.0, 1e-3, rng.random(), rng.random() * 1e-9 + 0.3))
            prefill[at].enqueue(rid, predicted)
            book.enqueue(at, rid, predicted)
            queued[at].append(rid)
        elif kind < 0.6:
            waiting = [r for r in queued[at] if r not in started[at]]
            if waiting:
                rid = rng.choice(waiting)
                prefill[at].start(rid, now)
                book.start(at, rid, now)
                started[at].add(rid)
        elif kind < 0.8:
            if queued[at]:
                rid = rng.choice(queued[at])
                prefill[at].finish(rid)
                book.finish(at, rid)
                queued[at].remove(rid)
                started[at].discard(rid)
        else:
            d = rng.randrange(m)
            if decoding[d] and rng.random() < 0.4:
                rid = decoding[d].pop(rng.randrange(len(decoding[d])))
                decode[d].remove_decode(rid)
                book.remove_decode(d, rid)
            else:
                rid, tokens = f"d{op}", rng.randrange(0, 5000)
                decode[d].add_decode(rid, tokens)
                book.add_decode(d, rid, tokens)
                decoding[d].append(rid)
        if rng.random() < 0.5:  # not every op is followed by a read
            read_now = rng.choice((now, None))
            pb, db = book.prefill(read_now), book.decode()
            if peak is not None:
                peak.append(len(book._running))
            if not (_same(pb, ptable.read(read_now)) and _same(db, dtable.read(read_now))):
                return op
            # the groups are read at once (the owner changes them in place): they must say what
            # the arrays say, in position order
            if pb.decode_groups is not None or db.decode_groups != _groups_of(db):
                return op
            handed_out.append((pb, db, _bytes(pb, db)))
    for pb, db, then in handed_out:  # copy on write: a read's arrays never change later
        if _bytes(pb, db) != then:
            return ops
    return None


@pytest.mark.parametrize("seed", range(6))
def test_sim_loads_equal_a_load_table_op_for_op(seed: int) -> None:
    peak: list[int] = []
    book = SimLoads([f"prefill-{i}" for i in range(24)], [f"decode-{i}" for i in range(8)])
    assert _diverges(book, seed, peak=peak) is None
    # both of the table's sums are met: few running rows (Python) and many (numpy); SimLoads
    # always sums in Python
    assert min(peak) < MANY_RUNNING <= max(peak)


# the broken variants subclass the interpreted SimLoads (a compiled class takes no interpreted
# subclass): the same code
_SourceSimLoads = interpreted("kvflow.router.sim_loads").SimLoads
_IDS = ([f"prefill-{i}" for i in range(24)], [f"decode-{i}" for i in range(8)])


class _BrokenUnwait(_SourceSimLoads):
    def start(self, at: int, request_id: str, now: float) -> None:  # the sum without the max
        left = self._waiting_s[at] - self._queue[at][request_id]
        super().start(at, request_id, now)
        if self._waiting[at]:
            self._waiting_s[at] = left
            self._prefill_row(at, left)


class _BrokenRunningOrder(_SourceSimLoads):
    def start(self, at: int, request_id: str, now: float) -> None:  # newest first
        super().start(at, request_id, now)
        started = self._started[at]
        items = list(started.items())
        started.clear()
        started.update(reversed(items))
        self._prefill_row(at, self._waiting_s[at])


class _BrokenDecode(_SourceSimLoads):
    def remove_decode(self, at: int, request_id: str) -> None:  # forgets the tokens
        tokens = self._decoding[at][request_id]
        super().remove_decode(at, request_id)
        self._context[at] += tokens  # not shared: remove_decode copied it if it was


class _GroupsUnsorted(_SourceSimLoads):
    def _decode_row(self, at: int, batch: int, context: int) -> None:  # appends, not insort
        super()._decode_row(at, batch, context)
        members = self._groups[(batch, context)]
        members.remove(at)
        members.append(at)


class _NoCopyOnWrite(_SourceSimLoads):
    def _prefill_row(self, at: int, waiting_s: float) -> None:
        self._queued_shared = self._static_shared = False
        super()._prefill_row(at, waiting_s)


class _StaticNotCopied(_SourceSimLoads):  # the waiting seconds a read handed out when nothing ran
    def _prefill_row(self, at: int, waiting_s: float) -> None:
        self._static_shared = False
        super()._prefill_row(at, waiting_s)


def test_the_unbroken_interpreted_twin_agrees() -> None:
    assert all(_diverges(_SourceSimLoads(*_IDS), seed) is None for seed in range(6))


@pytest.mark.parametrize("broken", [_BrokenUnwait, _BrokenRunningOrder, _BrokenDecode,
                                    _GroupsUnsorted, _NoCopyOnWrite, _StaticNotCopied])  # fmt: skip
def test_the_comparison_catches_a_broken_update(broken: type[SimLoads]) -> None:
    assert any(_diverges(broken(*_IDS), seed) is not None for seed in range(6))


def test_route_loads_decides_as_route_over_the_same_loads() -> None:
    states = (
        tuple(InstanceState(f"prefill-{i}", InstanceKind.PREFILL) for i in range(4)),
        tuple(InstanceState(f"decode-{i}", InstanceKind.DECODE) for i in range(2)),
    )
    book = SimLoads([s.instance_id for s in states[0]], [s.instance_id for s in states[1]])
    for i, predicted in enumerate((0.5, 0.1, 0.3, 0.2)):
        states[0][i].enqueue(f"q{i}", predicted)
        book.enqueue(i, f"q{i}", predicted)
    states[0][1].start("q1", 1.0)
    book.start(1, "q1", 1.0)
    states[1][0].add_decode("d", 4000)
    book.add_decode(0, "d", 4000)
    index = LocalPrefixIndex(100)
    index.insert("prefill-2", [b"k1"])
    a, b = (
        Conductor(RouterConfig(block_size=16), index, PREFILL, DECODE, TransferEstimator(1e9))
        for _ in range(2)
    )
    req = RouteRequest("x", (b"k1", b"k2"), 40)
    assert a.route(req, *states, now=1.05) == b.route_loads(req, book.prefill(1.05), book.decode())
    assert np.array_equal(book.prefill(None).queued_requests, [1, 1, 1, 1])


@pytest.mark.parametrize("seed", range(4))
def test_route_loads_picks_the_reference_decode_instance_over_groups(seed: int) -> None:
    """The decode choice over SimLoads' groups (one prediction per distinct load) against the
    per-instance reference: idle instances tie exactly, busy ones sometimes share a load, and
    requests hash to different tied picks. A pick off by one position, or a lost tie, differs."""
    rng = random.Random(seed)
    n, m = 3, 12
    states = (
        tuple(InstanceState(f"prefill-{i}", InstanceKind.PREFILL) for i in range(n)),
        tuple(InstanceState(f"decode-{i}", InstanceKind.DECODE) for i in range(m)),
    )
    book = SimLoads([s.instance_id for s in states[0]], [s.instance_id for s in states[1]])
    config = RouterConfig(block_size=16, tbt_slo_s=rng.choice([None, 0.0105]))
    fast = Conductor(config, LocalPrefixIndex(100), PREFILL, DECODE, TransferEstimator(1e9))
    reference = ReferenceConductor(
        config, LocalPrefixIndex(100), PREFILL, DECODE, TransferEstimator(1e9)
    )
    decoding: list[list[str]] = [[] for _ in range(m)]
    picked: set[str] = set()
    for op in range(400):
        d = rng.randrange(m)
        if decoding[d] and rng.random() < 0.45:
            rid = decoding[d].pop(rng.randrange(len(decoding[d])))
            states[1][d].remove_decode(rid)
            book.remove_decode(d, rid)
        else:  # few distinct contexts, so busy instances share loads too
            rid, tokens = f"d{op}", rng.choice((100, 200, rng.randrange(5000)))
            states[1][d].add_decode(rid, tokens)
            book.add_decode(d, rid, tokens)
            decoding[d].append(rid)
        req = RouteRequest(f"req-{op}", (), rng.randrange(1, 3000))
        want = reference.route(req, *states, now=1.0)
        got = fast.route_loads(req, book.prefill(1.0), book.decode())
        assert got == want, f"op {op}"
        if isinstance(got, RouteDecision):
            assert list(got.decode_candidates) == list(want.decode_candidates)
            picked.add(got.decode_id)
    assert len(picked) > m // 2  # ties spread: the test saw many picks
