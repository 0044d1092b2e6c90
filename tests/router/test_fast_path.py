"""The vectorised conductor against the per-instance reference, on seeded random clusters.

Every decision (instance ids, pull plans, every predicted float, every candidate record) and
every rejection must be *equal*, not approximately equal: the fast path promises the reference's
floating-point operations in the reference's order. The cluster changes between decisions
(commits, starts, finishes, health, reported load) so the load tables' incremental refresh is
exercised too.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvflow.router import (
    Conductor,
    DecodeTimeModel,
    InstanceKind,
    InstanceState,
    LocalPrefixIndex,
    PrefillTimeModel,
    Rejection,
    RouteDecision,
    RouterConfig,
    RouteRequest,
    TransferEstimator,
    UnknownInstanceError,
    load_table,
    policy_names,
)
from kvflow.router.load_table import LoadTable
from kvflow.router.reference import ReferenceConductor

BLOCK = 16
PREFILL = PrefillTimeModel((2e-3, 1e-4, 3e-9, 2e-6), "fast-path")
DECODE = DecodeTimeModel((1e-2, 1e-4, 2e-8), "fast-path")


def _cluster(rng: random.Random) -> tuple[list[InstanceState], list[InstanceState]]:
    """1-40 prefill and 1-12 decode instances; none, half or all of them start busy (idle
    instances make exact ties, busy ones arbitrary floats)."""
    prefill = [InstanceState(f"p{i}", InstanceKind.PREFILL) for i in range(rng.randint(1, 40))]
    decode = [InstanceState(f"d{i}", InstanceKind.DECODE) for i in range(rng.randint(1, 12))]
    busy = rng.choice([0.0, 0.5, 1.0])
    for state in prefill:
        for j in range(rng.randint(1, 3) if rng.random() < busy else 0):
            state.enqueue(f"init-{j}", rng.uniform(0.0, 1.5))
    for state in decode:
        for j in range(rng.randint(1, 20) if rng.random() < busy else 0):
            state.add_decode(f"init-{j}", rng.randint(1, 4000))
    return prefill, decode


def _chains(rng: random.Random) -> list[tuple[bytes, ...]]:
    return [tuple(f"c{c}-{j}".encode() for j in range(rng.randint(1, 24))) for c in range(12)]


def _request(rng: random.Random, n: int, chains: list[tuple[bytes, ...]]) -> RouteRequest:
    keys = rng.choice(chains)[: rng.randint(0, 24)] + tuple(
        f"fresh-{n}-{j}".encode() for j in range(rng.randint(0, 3))
    )
    prompt = max(1, len(keys) * BLOCK - rng.randint(0, BLOCK - 1))
    return RouteRequest(f"req-{n}", keys, prompt)


def _perturb(
    rng: random.Random,
    prefill: list[InstanceState],
    decode: list[InstanceState],
    index: LocalPrefixIndex,
    chains: list[tuple[bytes, ...]],
    now: float,
    n: int,
) -> None:
    """One random change of the cluster (what a server or the simulator does between routes)."""
    state = rng.choice(prefill)
    roll = rng.random()
    if roll < 0.3:
        state.enqueue(f"x{n}", rng.choice([0.0, 0.25, rng.uniform(0.0, 2.0), rng.random()]))
        if rng.random() < 0.5:
            state.start(f"x{n}", now - rng.uniform(0.0, 1.0))
    elif roll < 0.45 and state.queued_requests:
        for request_id in (f"x{m}" for m in range(n - 1, -1, -1)):  # the latest one still there
            try:
                state.finish(request_id)
                break
            except UnknownInstanceError:
                continue
    elif roll < 0.55:
        state.set_healthy(rng.random() < 0.8)
    elif roll < 0.65:
        state.set_reported_load(rng.uniform(0.0, 3.0), 0, 0, now=now)
    elif roll < 0.8:
        d = rng.choice(decode)
        d.add_decode(f"y{n}", rng.randint(0, 5000))
        if rng.random() < 0.2:
            d.set_healthy(rng.random() < 0.8)
    else:
        chain = rng.choice(chains)
        index.insert(state.instance_id, chain[: rng.randint(1, len(chain))])


def _config(rng: random.Random, policy: str) -> RouterConfig:
    return RouterConfig(
        policy=policy,
        ttft_slo_s=rng.choice([None, 0.5, 1.5, 3.0]),
        tbt_slo_s=rng.choice([None, 0.02, 0.05]),
        balancing_threshold=rng.choice([1.0, 1.5, 2.0, 4.0]),
        block_size=BLOCK,
        block_nbytes=rng.choice([1 << 10, 1 << 16, 1 << 20]),
        seed=rng.randrange(1000),
    )


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("seed", range(6))
def test_fast_decisions_equal_the_reference(
    policy: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(load_table, "MANY_RUNNING", [1, 4, 10**9][seed % 3])
    rng = random.Random(seed * 1009 + len(policy))
    prefill, decode = _cluster(rng)
    chains = _chains(rng)
    index = LocalPrefixIndex(capacity_blocks=rng.choice([None, 20, 60]))
    for _ in range(len(prefill)):
        chain = rng.choice(chains)
        index.insert(rng.choice(prefill).instance_id, chain[: rng.randint(1, len(chain))])
    config = _config(rng, policy)
    transfer = TransferEstimator(rng.choice([1e6, 1e8, 1e10]), 1e-4)
    fast = Conductor(config, index, PREFILL, DECODE, transfer)
    reference = ReferenceConductor(config, index, PREFILL, DECODE, transfer)
    seen: Counter[str] = Counter()
    for n in range(250):
        now = n * 0.05 if rng.random() < 0.9 else None
        req = _request(rng, n, chains)
        got = fast.route(req, prefill, decode, now=now)
        want = reference.route(req, prefill, decode, now=now)
        assert got == want, f"decision {n} differs"
        assert type(got) is type(want)
        if isinstance(got, RouteDecision):
            assert tuple(got.candidates) == want.candidates  # the lazy records, materialised
            seen["pull" if got.pull else "local"] += 1
        else:
            assert isinstance(got, Rejection)
            seen[got.reason.value] += 1
        _perturb(rng, prefill, decode, index, chains, n * 0.05, n)
    assert sum(seen.values()) == 250  # (what the cases reach: the test below)


def test_the_random_states_reach_pulls_ties_and_rejections() -> None:
    """Guards the test above against a generator that stopped producing the hard cases."""
    totals: Counter[str] = Counter()
    for seed in range(6):
        rng = random.Random(seed)
        prefill, decode = _cluster(rng)
        chains = _chains(rng)
        index = LocalPrefixIndex()
        config = RouterConfig(ttft_slo_s=1.5, block_size=BLOCK, block_nbytes=1 << 10)
        conductor = Conductor(config, index, PREFILL, DECODE, TransferEstimator(1e10, 1e-4))
        for n in range(250):
            result = conductor.route(_request(rng, n, chains), prefill, decode, now=n * 0.05)
            if isinstance(result, Rejection):
                totals[result.reason.value] += 1
            else:
                totals["pull"] += result.pull is not None
                ttfts = [c.balanced.ttft for c in result.candidates]
                totals["tied"] += ttfts.count(min(ttfts)) > 1
                totals["busy"] += len(set(ttfts)) == len(ttfts) > 1
            _perturb(rng, prefill, decode, index, chains, n * 0.05, n)
    assert min(totals[k] for k in ("pull", "ttft_slo", "tied", "busy")) > 10, totals


@pytest.mark.parametrize("many_running", [1, 10**9])  # running rows summed in numpy / Python
def test_load_table_equals_snapshots(many_running: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_table, "MANY_RUNNING", many_running)
    rng = random.Random(3)
    prefill, decode = _cluster(rng)
    chains = _chains(rng)
    index = LocalPrefixIndex()
    table = LoadTable(prefill, InstanceKind.PREFILL)
    running = 0
    for n in range(300):
        now = n * 0.05 if n % 7 else None
        loads = table.read(now)
        snaps = [s.snapshot(now) for s in prefill if s.snapshot(now).healthy]
        assert loads.instance_ids == tuple(s.instance_id for s in snaps)
        assert loads.queued_seconds.tolist() == [s.queued_seconds for s in snaps]
        assert loads.queued_requests.tolist() == [s.queued_requests for s in snaps]
        running = max(running, sum(1 for s in prefill if s.load_terms().running))
        _perturb(rng, prefill, decode, index, chains, n * 0.05, n)
    assert running >= 3  # rows with running requests were compared
    with pytest.raises(ValueError, match="expected prefill"):
        LoadTable(decode, InstanceKind.PREFILL)


def test_a_new_instance_list_is_read_afresh() -> None:
    index = LocalPrefixIndex()
    config = RouterConfig(block_size=BLOCK)
    conductor = Conductor(config, index, PREFILL, DECODE, TransferEstimator(1e9))
    prefill = [InstanceState(f"p{i}", InstanceKind.PREFILL) for i in range(3)]
    decode = [InstanceState("d0", InstanceKind.DECODE)]
    prefill[0].enqueue("busy", 1.0)
    req = RouteRequest("r", (b"k",), BLOCK)
    first = conductor.route(req, prefill, decode)
    assert isinstance(first, RouteDecision) and first.prefill_id != "p0"
    replaced = [InstanceState("p0", InstanceKind.PREFILL), *prefill[1:]]
    replaced[1].enqueue("busy", 1.0)
    replaced[2].enqueue("busy", 1.0)
    again = conductor.route(req, replaced, decode)
    assert isinstance(again, RouteDecision) and again.prefill_id == "p0"
    with pytest.raises(ValueError, match="expected decode"):
        conductor.route(req, prefill, prefill)


def test_load_table_reuses_a_read_only_while_nothing_changed() -> None:
    prefill = [InstanceState("p0", "prefill"), InstanceState("p1", "prefill")]
    decode = [InstanceState("d0", "decode"), InstanceState("d1", "decode")]
    prefill_table = LoadTable(prefill, InstanceKind.PREFILL)
    decode_table = LoadTable(decode, InstanceKind.DECODE)
    first = decode_table.read(1.0)
    assert decode_table.read(2.0) is first  # nothing changed, nothing depends on now
    decode[1].add_decode("r", 100)
    again = decode_table.read(2.0)
    assert again is not first and again.decode_context_tokens.tolist() == [0, 100]
    assert first.decode_context_tokens.tolist() == [0, 0]  # a handed-out read never changes
    prefill[0].enqueue("a", 1.0)
    idle = prefill_table.read(0.0)
    assert prefill_table.read(5.0) is idle  # waiting work does not depend on now
    prefill[0].start("a", 0.0)
    assert prefill_table.read(0.25).queued_seconds.tolist() == [0.75, 0.0]
    assert prefill_table.read(0.5).queued_seconds.tolist() == [0.5, 0.0]  # running: read afresh
