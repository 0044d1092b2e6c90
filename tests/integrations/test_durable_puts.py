"""Acknowledged means durable (docs/durability.md): a put with ``replica_num=N`` that returned 0
survives the loss of N-1 holders, the writer included. Real processes (spawned), real sockets,
SIGKILL; a one-replica metadata group in this process, and this process as the reader.

- the KV oracle: seeded schedules of puts from several writers, SIGKILLs of writers and of
  N-1 holders at random moments; afterwards every acknowledged value reads back byte-exact
  and every attempted but unacknowledged one is absent or complete.
- the Mooncake promise (issue 24): ``get`` after the writer and N-1 holders are SIGKILLed.
- ... and when the last copy's holder is only slow (SIGSTOP a little longer than the peer
  call's ``base_s``, as a loaded host can be): ``get`` waits it out, within a bounded patience.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import pytest

from kvflow.integrations.mooncake import MooncakeDistributedStore
from kvflow.kvdb import PeerCallBudget
from kvflow.replication import MetadataConfig, MetadataGroup
from kvflow.replication.service import create_meta_server
from kvflow.security import SECRET_FILE_ENV, generate_secret_file
from tests.conftest import pick_free_port
from tests.integrations import durable_procs
from tests.integrations.durable_procs import member_config, value_of

pytestmark = [pytest.mark.slow, pytest.mark.faults]

logger = logging.getLogger(__name__)

READY_S = 120.0  # a spawned member is up (imports + setup) on a loaded 2-core machine
RUN_S = 240.0  # the whole schedule


@pytest.fixture
def meta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A one-replica metadata group serving on 127.0.0.1, with a cluster secret every process
    of the test (children inherit the environment) authenticates with."""
    secret = tmp_path / "cluster.secret"
    generate_secret_file(secret)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))
    group = MetadataGroup(MetadataConfig(self_address=f"127.0.0.1:{pick_free_port()}"))
    group.start()
    group.wait_ready(30)
    server, port = create_meta_server(group, "127.0.0.1", 0)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(5)
    group.close()


@dataclass
class Child:
    name: str
    proc: Any  # a SpawnProcess
    conn: Connection
    holds: bool
    done: bool = False


@dataclass
class Procs:
    """Spawned children; ``stop_all`` ends every one (pipe closed, then SIGKILL if needed)."""

    meta: str
    children: dict[str, Child] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ctx = mp.get_context("spawn")

    def start(self, target: Any, name: str, holds: bool, *args: Any) -> Child:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=target, args=(self.meta, name, *args, child), name=name, daemon=True
        )
        proc.start()
        child.close()
        self.children[name] = c = Child(name, proc, parent, holds)
        return c

    def ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + READY_S
        for c in children:
            assert c.conn.poll(max(0.0, deadline - time.monotonic())), f"{c.name} never started"
            msg = c.conn.recv()
            assert msg == ("ready", c.name, 0), msg

    def kill(self, name: str) -> None:
        c = self.children.pop(name)
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.join(30)
        c.conn.close()

    def stop_all(self) -> None:
        for c in self.children.values():
            c.conn.close()  # the child sees EOF and closes its store
        for c in self.children.values():
            c.proc.join(20)
            if c.proc.is_alive():
                os.kill(c.proc.pid, signal.SIGKILL)
                c.proc.join(10)
        self.children.clear()


@pytest.fixture
def procs(meta: str) -> Iterator[Procs]:
    p = Procs(meta)
    try:
        yield p
    finally:
        p.stop_all()


def _reader(meta: str, **overrides: Any) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    config = member_config(meta, f"reader-{os.getpid()}", holds=False) | overrides
    assert store.setup(config) == 0
    return store


def _holders_of(meta_reader: MooncakeDistributedStore, keys: list[str]) -> list[set[str]]:
    member = meta_reader._member
    assert member is not None and member.metadata is not None
    bkeys = [meta_reader._key(k) for k in keys]
    return [set(row) for row in member.metadata.view().holders(bkeys)]  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the oracle


@dataclass
class Ledger:
    """What the parent saw: attempted, acknowledged and refused keys, and the kills."""

    tried: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    refused: dict[str, int] = field(default_factory=dict)
    writer_kills: int = 0
    holder_kills: int = 0


@pytest.mark.parametrize(("seed", "replicas"), [(7, 2), (23, 3)])
def test_kv_oracle_acknowledged_puts_survive_writer_and_holder_kills(
    procs: Procs, meta: str, seed: int, replicas: int
) -> None:
    """N+1 holders, 3 writers that hold nothing (all N copies are pushed), 3 writer kills and
    N-1 holder kills at random acknowledged-put counts. With N=3, once two holders are dead
    too few members are left: later puts are refused, and must then be absent or complete."""
    holders, writers, puts_per_writer = replicas + 1, 3, 400
    rng = random.Random(seed)
    hs = [procs.start(durable_procs.holder, f"h{i}-s{seed}", True) for i in range(holders)]
    procs.ready(hs)
    total = writers * puts_per_writer
    # the kill schedule, in acknowledged puts seen: 3 writer kills and N-1 holder kills
    writer_kills = sorted(rng.randrange(total // 10, total * 8 // 10) for _ in range(3))
    holder_kills = sorted(rng.randrange(total // 10, total * 9 // 10) for _ in range(replicas - 1))
    ledger = Ledger()
    remaining = {w: puts_per_writer for w in range(writers)}
    gen = dict.fromkeys(range(writers), 0)
    live: dict[int, Child] = {}

    def spawn(w: int) -> None:
        name = f"w{w}g{gen[w]}-s{seed}"
        live[w] = procs.start(
            durable_procs.writer, name, False, seed, f"{name}-", remaining[w], replicas, False
        )
        procs.ready([live[w]])

    for w in range(writers):
        spawn(w)
    deadline = time.monotonic() + RUN_S
    while any(not c.done for c in live.values()):
        assert time.monotonic() < deadline, f"schedule did not finish: {ledger}"
        ready = wait([c.conn for c in live.values() if not c.done], timeout=1.0)
        for w, c in list(live.items()):
            if c.conn not in ready:
                continue
            try:
                msg = c.conn.recv()
            except EOFError:
                pytest.fail(f"writer {c.name} died unasked (exit {c.proc.exitcode})")
            if msg[0] == "try":
                ledger.tried.add(msg[1])
            elif msg[0] == "ack":
                ledger.acked.add(msg[1])
                remaining[w] -= 1
            elif msg[0] == "fail":
                ledger.refused[msg[1]] = msg[2]
                remaining[w] -= 1
            elif msg[0] == "done":
                c.done = True
        seen = len(ledger.acked)
        while writer_kills and seen >= writer_kills[0]:
            writer_kills.pop(0)
            victims = [w for w, c in live.items() if not c.done]
            if victims:
                w = rng.choice(victims)
                procs.kill(live.pop(w).name)
                ledger.writer_kills += 1
                gen[w] += 1
                if remaining[w] > 0:
                    spawn(w)
        while holder_kills and seen >= holder_kills[0]:
            holder_kills.pop(0)
            victim = rng.choice([c for c in hs if c.name in procs.children])
            procs.kill(victim.name)
            ledger.holder_kills += 1
    assert ledger.holder_kills == replicas - 1 and ledger.writer_kills >= 1, ledger

    reader = _reader(meta)
    try:
        wrong = [k for k in sorted(ledger.acked) if reader.get(k) != value_of(seed, k)]
        half = [
            k
            for k in sorted(ledger.tried - ledger.acked)
            if reader.get(k) not in (b"", value_of(seed, k))
        ]
    finally:
        reader.close()
    logger.warning(
        "kv oracle seed=%d: %d puts tried, %d acknowledged, %d refused, %d writer kills, "
        "%d holder kills, %d acknowledged values verified, %d unacknowledged checked",
        seed,
        len(ledger.tried),
        len(ledger.acked),
        len(ledger.refused),
        ledger.writer_kills,
        ledger.holder_kills,
        len(ledger.acked) - len(wrong),
        len(ledger.tried - ledger.acked),
    )
    assert not wrong, f"{len(wrong)} acknowledged values lost or wrong, e.g. {wrong[:5]}"
    assert not half, f"{len(half)} unacknowledged values half-visible, e.g. {half[:5]}"
    assert len(ledger.acked) >= total // 10, ledger  # the schedule really wrote


# ------------------------------------------------------------------ the Mooncake promise


def _acked_keys(w: Child, n: int) -> list[str]:
    """The keys writer ``w`` reports acknowledged, once it says it is done: all ``n`` of them."""
    got: list[tuple[Any, ...]] = []
    while not got or got[-1] != ("done",):
        assert w.conn.poll(READY_S), got[-3:]
        got.append(w.conn.recv())
    keys = [m[1] for m in got if m[0] == "ack"]
    assert len(keys) == n, got
    return keys


@pytest.mark.parametrize(
    ("writer_holds", "replicas"),
    [(False, 2), (True, 3)],
    ids=["client-writer-2-replicas", "holding-writer-3-replicas"],
)
def test_get_after_the_writer_and_n_minus_1_holders_are_sigkilled(
    procs: Procs, meta: str, writer_holds: bool, replicas: int
) -> None:
    """A client writer (it holds nothing, like a Mooncake client with no segment) puts with
    ``replica_num=2``; the writer and one holder die: every value is read back. A writer that
    holds its own copy puts with ``replica_num=3``: the writer and one other holder die (N-1
    copies lost): every value is read back."""
    seed, n = 5, 24
    hs = [procs.start(durable_procs.holder, f"h{i}", True) for i in range(3)]
    procs.ready(hs)
    w = procs.start(durable_procs.writer, "w", writer_holds, seed, "k", n, replicas, writer_holds)
    procs.ready([w])
    keys = _acked_keys(w, n)
    reader = _reader(procs.meta)
    try:
        rows = _holders_of(reader, keys)
        assert all(len(r) == replicas for r in rows), rows
        # the holder with the most copies dies with the writer (N-1 copies lost at most)
        counts = {h.name: sum(h.name in r for r in rows) for h in hs}
        victim = max(counts, key=lambda h: (counts[h], h))
        assert counts[victim] > 0
        procs.kill("w")
        procs.kill(victim)
        assert [reader.get(k) for k in keys] == [value_of(seed, k) for k in keys]
    finally:
        reader.close()


def _timed_get(reader: MooncakeDistributedStore, key: str) -> tuple[float, bytes]:
    t0 = time.monotonic()
    value = reader.get(key)
    return time.monotonic() - t0, value


def test_get_waits_out_a_slow_last_holder_and_gives_up_on_a_paused_one(
    procs: Procs, meta: str
) -> None:
    """The loaded-host failure without the load: two holders, a client writer puts with
    ``replica_num=2``, the writer and h1 are SIGKILLed and h0, the last holder, is paused
    (SIGSTOP) for a little longer than a peer call's ``base_s``; a timer resumes it. Its Lease
    times out, h1 refuses: ``get`` must still return the value (the last-resort try waits up
    to ``last_resort_s``), not b"" (for a Mooncake client: the object is gone).

    Paused for good, h0 costs a get one plain deadline plus one ``last_resort_s`` and the
    answer is b""; the next get does not wait ``last_resort_s`` again (h0 gets no other last
    resort until it answers)."""
    seed, n = 11, 3
    budget = PeerCallBudget()  # what the reader's peer calls use
    hs = [procs.start(durable_procs.holder, f"h{i}", True) for i in range(2)]
    procs.ready(hs)
    w = procs.start(durable_procs.writer, "w", False, seed, "s", n, 2, False)
    procs.ready([w])
    keys = _acked_keys(w, n)
    # the reader counts a silent peer as live for long: h0 is paused, not dead
    reader = _reader(procs.meta, kvflow_peer_dead_after_s=120.0)
    h0 = procs.children["h0"].proc.pid
    resume = threading.Timer(budget.base_s + 0.7, os.kill, (h0, signal.SIGCONT))
    try:
        assert all(r == {"h0", "h1"} for r in _holders_of(reader, keys))
        procs.kill("w")
        procs.kill("h1")
        os.kill(h0, signal.SIGSTOP)
        resume.start()
        slow, value = _timed_get(reader, keys[0])
        assert value == value_of(seed, keys[0]), f"a miss after {slow:.2f}s"
        assert budget.base_s <= slow < budget.base_s + budget.last_resort_s, slow
        resume.join()

        os.kill(h0, signal.SIGSTOP)  # for good
        took, value = _timed_get(reader, keys[1])
        assert value == b""
        assert budget.last_resort_s <= took < 2 * budget.base_s + budget.last_resort_s + 3.0
        took2, value = _timed_get(reader, keys[2])
        assert value == b""
        assert took2 < budget.last_resort_s, took2  # no second last-resort wait
        logger.warning(
            "slow last holder: the get took %.2fs; paused for good: %.2fs, then %.2fs",
            slow, took, took2,
        )  # fmt: skip
    finally:
        resume.cancel()
        os.kill(h0, signal.SIGCONT)
        reader.close()
