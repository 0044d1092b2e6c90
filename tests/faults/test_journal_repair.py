"""A damaged metadata journal (real files written by a real replica) is found before
pysyncobj reads it, moved aside with one log line, and the replica starts. Before issue 25
item 3 a truncated journal made pysyncobj's constructor raise on every start (a crash loop
under a supervisor), and a damaged snapshot was skipped with its state silently missing."""

from __future__ import annotations

import gzip
import logging
import random
import time
from pathlib import Path

import pytest

from kvflow.replication import MetadataConfig, MetadataGroup, NodeId, Tier
from kvflow.replication.config import DUMP_FILE, JOURNAL_FILE
from kvflow.replication.errors import NotLeaderError
from kvflow.replication.journal_repair import (
    JournalDamage,
    VoteHold,
    check_journal,
    repair_journal,
)
from kvflow.security import SECRET_FILE_ENV, generate_secret_file
from tests.conftest import pick_free_port
from tests.replication.helpers import wait_until
from tests.replication.procs import READY_S, MetaCluster

pytestmark = [pytest.mark.faults]

W = NodeId("writer")
KEYS = [i.to_bytes(16, "big") for i in range(40)]


def _journal(tmp_path: Path) -> Path:
    """A real single-replica journal with KEYS recorded."""
    journal = tmp_path / "meta"
    config = MetadataConfig(self_address=f"127.0.0.1:{pick_free_port()}", journal_dir=journal)
    with MetadataGroup(config) as group:
        group.wait_ready(30.0)
        for i in range(0, len(KEYS), 4):
            group.record_batch(W, [(k, Tier.DRAM) for k in KEYS[i : i + 4]], [], now=1.0)
    return journal


def test_a_whole_journal_passes(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    assert (journal / JOURNAL_FILE).stat().st_size > 0
    check_journal(journal)


@pytest.mark.parametrize("mode", ["truncated", "garbage", "header", "meta"])
def test_damage_is_found(tmp_path: Path, mode: str) -> None:
    journal = _journal(tmp_path)
    log = journal / JOURNAL_FILE
    data = bytearray(log.read_bytes())
    end = int.from_bytes(data[36:40], "little")
    rng = random.Random(25)
    if mode == "truncated":
        log.write_bytes(data[: end // 2])
    elif mode == "garbage":
        start = 40 + (end - 40) // 3
        data[start : start + 48] = rng.randbytes(48)
        log.write_bytes(data)
    elif mode == "header":
        data[0:40] = rng.randbytes(40)
        log.write_bytes(data)
    else:
        meta = journal / (JOURNAL_FILE + ".meta")
        meta.write_bytes(meta.read_bytes()[:-3])
    with pytest.raises(JournalDamage, match=str(journal)):
        check_journal(journal)


def test_a_damaged_snapshot_is_found(tmp_path: Path) -> None:
    journal = tmp_path / "meta"
    journal.mkdir()
    with gzip.open(journal / DUMP_FILE, "wb") as out:
        out.write(random.Random(1).randbytes(100_000))
    check_journal(journal)
    dump = journal / DUMP_FILE
    dump.write_bytes(dump.read_bytes()[:-20])
    with pytest.raises(JournalDamage, match="damaged snapshot"):
        check_journal(journal)


def test_a_single_replica_with_a_damaged_journal_moves_it_aside_and_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = _journal(tmp_path)
    log = journal / JOURNAL_FILE
    log.write_bytes(log.read_bytes()[:100])
    config = MetadataConfig(self_address=f"127.0.0.1:{pick_free_port()}", journal_dir=journal)
    with caplog.at_level(logging.INFO, logger="kvflow.replication"), MetadataGroup(config) as g:
        g.wait_ready(30.0)
        assert g.view().num_blocks() == 0  # empty: a store re-adopts its holdings
        g.record_batch(W, [(KEYS[0], Tier.DRAM)], [], now=2.0)
    lines = [r.getMessage() for r in caplog.records if "journal damaged" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "moved aside" in lines[0] and "starting empty" in lines[0]
    aside = sorted(p.name for p in journal.iterdir() if ".damaged-" in p.name)
    assert [n.split(".damaged-")[0] for n in aside] == [JOURNAL_FILE, JOURNAL_FILE + ".meta"]
    check_journal(journal)  # the fresh journal it wrote is whole
    assert repair_journal(journal, has_peers=False) is False


CAUGHT_UP = "caught up after a journal repair"


def _first_index(journal_dir: Path) -> int:
    """The Raft index of the first entry left in a journal (after the 40-byte header)."""
    data = (journal_dir / JOURNAL_FILE).read_bytes()
    return int.from_bytes(data[44:52], "little") if (journal_dir / DUMP_FILE).exists() else 0


def _output(cluster: MetaCluster, i: int) -> str:
    return cluster.replicas[i].log_path.read_text()


@pytest.mark.slow
@pytest.mark.cluster
def test_a_replica_with_a_damaged_journal_rejoins_from_its_peers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three replica processes; one is killed, its journal truncated (then, a second time,
    overwritten with garbage), and restarted: it moves the journal aside, says so once,
    catches up from the others (entries written while it was down included), and then votes
    again (the group elects a leader with it after the old leader is killed)."""
    secret = tmp_path / "cluster.secret"
    generate_secret_file(secret)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))  # the replicas' and this test's clients'
    cluster = MetaCluster(tmp_path, 3)
    written: list[bytes] = []
    rng = random.Random(25)
    try:
        cluster.start_all()
        leader = cluster.leader_index()
        victim = (leader + 1) % 3
        with cluster.client() as client:

            def write(n: int) -> None:
                for _ in range(n):
                    batch = [rng.randbytes(16) for _ in range(20)]
                    client.record_batch(W, [(k, Tier.DRAM) for k in batch], [], now=1.0)
                    written.extend(batch)

            write(10)
            for damage in ("truncate", "garbage"):
                cluster.kill(victim)
                log = cluster.journal_dir(victim) / JOURNAL_FILE
                data = bytearray(log.read_bytes())
                end = int.from_bytes(data[36:40], "little")
                if damage == "truncate":
                    log.write_bytes(data[: end // 2])
                else:
                    data[end // 2 : end // 2 + 64] = rng.randbytes(64)
                    log.write_bytes(data)
                write(5)  # entries the victim never saw
                cluster.start(victim)
                with cluster.client([victim]) as own:
                    view = own.view()
                    wait_until(
                        lambda v=view: set(written) <= set(v.keys_on(W)), READY_S, "catch-up"
                    )
                proc = cluster.replicas[victim].proc
                assert proc is not None and proc.poll() is None
                rounds = 1 if damage == "truncate" else 2
                wait_until(
                    lambda n=rounds: _output(cluster, victim).count(CAUGHT_UP) == n,
                    READY_S,
                    "the vote hold released",
                )
        output = _output(cluster, victim)
        assert output.count("metadata journal damaged") == 2, output[-3000:]
        assert "rejoining from the peers" in output
        aside = [p.name for p in cluster.journal_dir(victim).iterdir() if ".damaged-" in p.name]
        assert sum(n.startswith(JOURNAL_FILE + ".damaged-") for n in aside) == 2, aside
        # it votes again: with the old leader gone, the victim and the third elect a leader
        cluster.kill(leader)
        survivors = [i for i in range(3) if i != leader]
        assert cluster.leader_index(survivors) in survivors
        with cluster.client([victim]) as own:
            assert set(written) <= set(own.view().keys_on(W))
    finally:
        cluster.stop_all()


def test_a_repaired_replica_catches_up_from_a_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three in-process replicas that compact their logs every few entries: the leader no
    longer has the entries the emptied replica lacks, so it catches up from the leader's
    snapshot, then from the log."""
    addresses = [f"127.0.0.1:{pick_free_port()}" for _ in range(3)]

    def config(i: int) -> MetadataConfig:
        return MetadataConfig(
            self_address=addresses[i],
            partner_addresses=tuple(a for a in addresses if a != addresses[i]),
            journal_dir=tmp_path / f"meta-{i}",
            password="kvflow-test-group",
            raft_min_timeout_s=0.3,
            raft_max_timeout_s=0.8,
            connection_retry_s=0.2,
            log_compaction_min_entries=4,
            log_compaction_min_time_s=0.05,
        )

    groups = [MetadataGroup(config(i)) for i in range(3)]
    rng = random.Random(7)
    written: list[bytes] = []

    def write(live: list[MetadataGroup], n: int) -> None:
        # through whichever replica leads now: on a loaded machine the short election timeouts
        # can move the leadership mid-run (NotLeaderError: retried on the new leader)
        for _ in range(n):
            batch = [rng.randbytes(16) for _ in range(10)]
            deadline = time.monotonic() + READY_S
            while True:
                leader = next((g for g in live if g.is_leader()), None)
                try:
                    if leader is not None:
                        leader.record_batch(W, [(k, Tier.DRAM) for k in batch], [], now=1.0)
                        break
                except NotLeaderError:
                    pass
                assert time.monotonic() < deadline, "no leader took the write"
                time.sleep(0.05)
            written.extend(batch)

    try:
        for g in groups:
            g.start()
        for g in groups:
            g.wait_ready(30.0)
        write(groups, 20)
        groups[2].close()
        log = tmp_path / "meta-2" / JOURNAL_FILE
        log.write_bytes(log.read_bytes()[:50])
        write(groups[:2], 20)
        # both healthy logs compacted past their start: only a snapshot can bring the
        # emptied replica back
        wait_until(
            lambda: all(_first_index(tmp_path / f"meta-{i}") > 2 for i in (0, 1)),
            READY_S,
            "compaction",
        )
        with caplog.at_level(logging.INFO, logger="kvflow.replication"):
            groups[2] = MetadataGroup(config(2))
            groups[2].start()
            view = groups[2].view()
            wait_until(lambda: set(written) <= set(view.keys_on(W)), READY_S, "catch-up")
            wait_until(
                lambda: any(CAUGHT_UP in r.getMessage() for r in caplog.records),
                READY_S,
                "the vote hold released",
            )
        messages = [r.getMessage() for r in caplog.records]
        assert sum("metadata journal damaged" in m for m in messages) == 1, messages
        assert view.num_blocks() == len(written)
    finally:
        for g in groups:
            g.close()


def test_the_vote_hold_drops_vote_requests_only_while_held() -> None:
    hold = VoteHold(held=True)
    assert hold.withholds({"type": "request_vote", "term": 3})
    assert not hold.withholds({"type": "append_entries", "term": 3})
    hold.release("127.0.0.1:1")
    assert not hold.withholds({"type": "request_vote", "term": 3})
