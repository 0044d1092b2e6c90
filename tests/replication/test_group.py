"""A single in-process replica on a loopback port: leadership, batching, journal replay."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import replace

import pytest
from pysyncobj import FAIL_REASON

from kvflow.replication import (
    MetadataConfig,
    MetadataGroup,
    MetadataTimeoutError,
    MetadataUnavailableError,
    NodeId,
    NodeInfo,
    NotLeaderError,
    ReplicationError,
    Tier,
)
from kvflow.replication.raft import raise_for
from tests.conftest import pick_free_port
from tests.replication.conftest import GroupFactory, make_config
from tests.replication.helpers import blocks, commit_index, key, last_log_index, wait_until

A, B = NodeId("node-a"), NodeId("node-b")


def test_single_replica_elects_itself(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    group = open_group(single_config)
    group.wait_ready(timeout=10)
    assert group.is_leader()
    assert group.leader() == single_config.self_address
    assert group.view().is_leader() and group.view().leader() == single_config.self_address


def test_one_raft_entry_per_batch(open_group: GroupFactory, single_config: MetadataConfig) -> None:
    group = open_group(single_config)
    group.wait_ready(timeout=10)
    wait_until(lambda: commit_index(group) == last_log_index(group), 10, "the no-op committed")
    view = group.view()
    before, applied = commit_index(group), view.commands_applied()

    group.record_batch(A, blocks(0, 2000), [], now=1.0)
    assert commit_index(group) == before + 1
    assert view.commands_applied() == applied + 1
    assert view.num_blocks() == 2000

    group.record_batch(A, [], [], now=2.0)  # empty: no entry
    assert commit_index(group) == before + 1

    group.record_batch(A, blocks(0, 10, Tier.SSD), [key(i) for i in range(10, 20)], now=3.0)
    assert commit_index(group) == before + 2
    assert view.replicas(key(5)) == {A: Tier.SSD}
    assert view.replicas(key(15)) == {}
    assert view.blocks_on(A) == 1990


def test_oversized_batch_is_split_by_max_entry_bytes(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    group = open_group(replace(single_config, max_entry_bytes=1024))  # 56 keys of 16 bytes
    group.wait_ready(timeout=10)
    wait_until(lambda: commit_index(group) == last_log_index(group), 10, "the no-op committed")
    before = commit_index(group)
    group.record_batch(A, blocks(0, 200), [key(i) for i in range(300, 360)], now=1.0)
    # 260 keys of 16 bytes (+2 framing) in entries of at most 56 keys: 5 entries
    assert commit_index(group) == before + 5
    assert group.view().blocks_on(A) == 200
    group.replace_holdings(A, blocks(100, 300, Tier.SSD), now=2.0)
    assert commit_index(group) == before + 5 + 4
    assert group.view().keys_on(A) == [key(i) for i in range(100, 300)]


def test_journal_replay_restores_state_after_reopen(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    group = open_group(single_config)
    group.wait_ready(timeout=10)
    group.register_node(A, "127.0.0.1:7001", "prefill", now=1.0)
    group.record_batch(A, blocks(0, 300), [], now=2.0)
    group.record_batch(B, blocks(200, 400, Tier.SSD), [key(0)], now=3.0)
    group.replace_holdings(B, blocks(250, 450, Tier.SSD), now=4.0)
    group.set_replica_target(key(260), 3, now=5.0)
    expected_holders = group.view().holders([key(i) for i in range(0, 500)])
    expected_nodes = group.view().nodes()
    group.close()
    assert single_config.journal_path is not None and single_config.journal_path.exists()

    # a new process would pick a new port; the journal directory is what carries the state
    reopened = open_group(replace(single_config, self_address=f"127.0.0.1:{pick_free_port()}"))
    reopened.wait_ready(timeout=10)
    view = reopened.view()
    assert view.holders([key(i) for i in range(0, 500)]) == expected_holders
    assert view.nodes() == expected_nodes
    assert view.replica_target(key(260)) == 3
    assert view.nodes()[0] == NodeInfo(A, "127.0.0.1:7001", "prefill", 1.0, 2.0, 300)
    reopened.record_batch(A, blocks(1000, 1001), [], now=6.0)  # and it still takes writes
    assert view.blocks_on(A) == 301


def test_compacted_state_dump_restores_after_reopen(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    config = replace(single_config, log_compaction_min_entries=10)
    group = open_group(config)
    group.wait_ready(timeout=10)
    for i in range(30):
        group.record_batch(A, blocks(i * 10, i * 10 + 10), [], now=float(i))
    assert config.dump_path is not None
    wait_until(config.dump_path.exists, 10, "a compacted state dump")
    wait_until(lambda: group.raft_status()["log_len"] < 30, 10, "the journal to be truncated")
    group.close()

    reopened = open_group(replace(config, self_address=f"127.0.0.1:{pick_free_port()}"))
    reopened.wait_ready(timeout=10)
    assert reopened.view().keys_on(A) == [key(i) for i in range(300)]
    assert reopened.view().commands_applied() == 30


def test_in_memory_journal_group_works(open_group: GroupFactory) -> None:
    group = open_group(make_config(f"127.0.0.1:{pick_free_port()}"))
    group.wait_ready(timeout=10)
    group.record_batch(A, blocks(0, 5), [], now=1.0)
    assert group.view().num_blocks() == 5


def test_heartbeat_and_reap_through_the_group(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    group = open_group(replace(single_config, node_dead_after_s=5.0))
    group.wait_ready(timeout=10)
    group.register_node(A, "a:1", "prefill", now=100.0)
    group.register_node(B, "b:1", "decode", now=100.0)
    group.record_batch(A, blocks(0, 10), [], now=100.0)
    group.record_batch(B, blocks(5, 15), [], now=100.0)
    assert group.heartbeat(B, now=104.0) is True
    assert group.reap_dead_nodes(now=105.0) == []
    assert group.reap_dead_nodes(now=105.5) == [A]
    view = group.view()
    assert [n.node for n in view.nodes()] == [B]
    assert view.replicas(key(0)) == {} and view.replicas(key(7)) == {B: Tier.DRAM}
    assert group.heartbeat(A, now=106.0) is False


def test_bad_input_proposes_nothing(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    group = open_group(single_config)
    group.wait_ready(timeout=10)
    before = commit_index(group)
    with pytest.raises(TypeError, match=r"stored\[1\]"):
        group.record_batch(A, [(key(1), Tier.DRAM), (key(2), "ssd")], [], now=1.0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="n: replica target"):
        group.set_replica_target(key(1), 0, now=1.0)
    with pytest.raises(ValueError, match="now"):
        group.heartbeat(A, now=float("inf"))
    with pytest.raises(TypeError, match="address and kind"):
        group.register_node(A, None, "prefill", now=1.0)  # type: ignore[arg-type]
    assert commit_index(group) == before
    assert group.view().num_blocks() == 0


def test_lifecycle_errors_and_idempotent_close(single_config: MetadataConfig) -> None:
    group = MetadataGroup(single_config)
    with pytest.raises(MetadataUnavailableError, match="not started"):
        group.record_batch(A, blocks(0, 1), [], now=1.0)
    with group:
        group.start()  # second start is a no-op
        group.wait_ready(timeout=10)
        group.record_batch(A, blocks(0, 1), [], now=1.0)
    group.close()
    with pytest.raises(MetadataUnavailableError, match="closed"):
        group.heartbeat(A, now=2.0)
    with pytest.raises(MetadataUnavailableError, match="closed"):
        group.start()
    assert group.leader() is None and not group.is_leader()


def test_bind_failure_is_reported(open_group: GroupFactory, single_config: MetadataConfig) -> None:
    open_group(single_config)  # holds the port
    clash = replace(single_config, journal_dir=None, bind_retries=1)
    with pytest.raises(MetadataUnavailableError, match="cannot bind"):
        open_group(clash)


def test_no_quorum_times_out(open_group: GroupFactory) -> None:
    # two partners that never start: no leader can be elected
    self_address, *partners = (f"127.0.0.1:{pick_free_port()}" for _ in range(3))
    group = open_group(make_config(self_address, tuple(partners), commit_timeout_s=0.5))
    with pytest.raises(MetadataTimeoutError, match="not ready"):
        group.wait_ready(timeout=0.5)
    with pytest.raises(MetadataTimeoutError, match=r"not committed within 0\.5s"):
        group.record_batch(A, blocks(0, 1), [], now=1.0)
    assert group.view().num_blocks() == 0


def test_concurrent_writers_and_readers(
    open_group: GroupFactory, single_config: MetadataConfig
) -> None:
    group = open_group(single_config)
    group.wait_ready(timeout=10)
    view = group.view()
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(worker: int) -> None:
        try:
            node = NodeId(f"node-{worker}")
            for batch in range(10):
                start = worker * 1000 + batch * 10
                group.record_batch(node, blocks(start, start + 10), [], now=float(batch))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def read() -> None:
        while not stop.is_set():
            view.holders([key(i) for i in range(0, 4000, 7)])
            view.nodes()

    reader = threading.Thread(target=read)
    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    reader.start()
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    reader.join()
    assert errors == []
    assert view.num_blocks() == 400
    assert [view.blocks_on(NodeId(f"node-{w}")) for w in range(4)] == [100] * 4


def test_close_fails_writes_in_flight_promptly(open_group: GroupFactory) -> None:
    self_address, *partners = (f"127.0.0.1:{pick_free_port()}" for _ in range(3))
    group = open_group(make_config(self_address, tuple(partners), commit_timeout_s=30.0))
    outcome: list[BaseException] = []

    def write() -> None:
        try:
            group.record_batch(A, blocks(0, 1), [], now=1.0)
        except BaseException as exc:
            outcome.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    wait_until(lambda: bool(group._waiting), 5, "the write to be in flight")
    started = time.monotonic()
    group.close()
    writer.join(timeout=5)
    assert not writer.is_alive() and time.monotonic() - started < 5
    assert len(outcome) == 1 and isinstance(outcome[0], MetadataUnavailableError)
    assert "closed while the write was in flight" in str(outcome[0])


@pytest.mark.parametrize(
    ("reason", "error", "text"),
    [
        (FAIL_REASON.NOT_LEADER, NotLeaderError, "leader hint: 127.0.0.1:9"),
        (FAIL_REASON.DISCARDED, NotLeaderError, "discarded"),
        (FAIL_REASON.MISSING_LEADER, MetadataUnavailableError, "no metadata leader"),
        (FAIL_REASON.QUEUE_FULL, MetadataUnavailableError, "queue is full"),
        (FAIL_REASON.REQUEST_DENIED, ReplicationError, "reason 6"),
    ],
)
def test_pysyncobj_fail_reasons_map_to_errors(
    reason: int, error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)) as raised:
        raise_for(reason, lambda: "127.0.0.1:9")
    if isinstance(raised.value, NotLeaderError):
        assert raised.value.leader_hint == "127.0.0.1:9"
    raise_for(FAIL_REASON.SUCCESS, lambda: None)  # success raises nothing
