"""The runtime pieces the embedded server and nodes share: the booking (idempotent release),
the lease book (expiry), the heartbeat (re-registration and re-adoption), the replicator
(placement from the metadata, copies into this process's shards only)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvflow.kvdb import StoreConfig, open_store
from kvflow.pipeline import Metrics
from kvflow.replication import MetadataConfig, MetadataGroup, NodeId, Tier
from kvflow.router import InstanceState
from kvflow.stages.runtime.heartbeat import Heartbeat, Member
from kvflow.stages.runtime.replicator import BlockCopy, Replicator
from kvflow.stages.runtime.staging import LeaseBook, StagingArea
from kvflow.stages.state import Booking
from tests.conftest import pick_free_port


def test_booking_releases_each_reservation_once() -> None:
    p, d = InstanceState("p", "prefill"), InstanceState("d", "decode")
    b = Booking("r")
    b.book_prefill(p, 1.5)
    b.book_decode(d, 100)
    assert p.queued_requests == 1 and d.decode_batch_size == 1
    b.release_prefill()
    b.release_prefill()
    assert p.queued_requests == 0 and d.decode_batch_size == 1
    b.release()
    b.release()
    assert d.decode_batch_size == 0
    p.enqueue("r", 1.0)  # someone else's booking of the same id is not touched by a re-release
    b.release()
    assert p.queued_requests == 1


def test_lease_book_hands_out_takes_and_expires() -> None:
    area = StagingArea("d", 8, (2, 4), torch.float32)
    book = LeaseBook(area, timeout_s=10.0)
    a, lease_a = book.lease("r1", 3)
    b, _ = book.lease("r2", 2)
    assert area.num_free == 3 and len(book) == 2
    assert book.take(a) == lease_a and book.take(a) is None  # taken once
    area.release(lease_a)
    assert book.reap(now=time.monotonic() + 11) == 1  # r2's lease expired
    assert area.num_free == 8 and book.release(b) is False


def test_a_lease_is_held_as_long_as_its_caller_asks_within_bounds() -> None:
    """A router asks for its request's time left: a Prefill queued past the default timeout
    still finds its slots; a lease asked for too little, or for ever, gets the bounds."""
    area = StagingArea("d", 8, (2, 4), torch.float32)
    book = LeaseBook(area, timeout_s=10.0)
    assert book.hold_s(0.0) == 10.0 and book.hold_s(3.0) == 10.0
    assert book.hold_s(float("nan")) == 10.0 and book.hold_s(float("inf")) == 10.0
    assert book.hold_s(300.0) == 300.0
    assert book.hold_s(1e9) == LeaseBook.MAX_HOLD_S
    held, _ = book.lease("r1", 2, hold_s=300.0)
    book.lease("r2", 2)
    assert book.reap(now=time.monotonic() + 11) == 1  # r2's default 10 s
    assert book.reap(now=time.monotonic() + 299) == 0 and book.release(held)


def _group(tmp_path: Path) -> MetadataGroup:
    g = MetadataGroup(MetadataConfig(self_address=f"127.0.0.1:{pick_free_port()}"))
    g.start()
    g.wait_ready(10.0)
    return g


def _store(tmp_path: Path, name: str, group: MetadataGroup):  # type: ignore[no-untyped-def]
    return open_store(
        StoreConfig(
            data_dir=tmp_path / name,
            dram_capacity_bytes=1 << 20,
            ssd_capacity_bytes=1 << 22,
            engine="memory",
            value_size=64,
        ),
        "model-a",
        node_id=NodeId(name),
        metadata=group,
    )


def test_heartbeat_re_registers_a_forgotten_member_and_re_adopts_its_blocks(tmp_path: Path) -> None:
    group = _group(tmp_path)
    store = _store(tmp_path, "n1", group)
    try:
        store.shard.put(b"k" * 16, bytes(64))
        hb = Heartbeat(group, [Member("n1", "addr-1", "prefill", store.shard)])
        hb.register_all()
        hb.beat_once()
        group.reap_dead_nodes(time.time() + 3600)  # the group forgets n1 and its replicas
        assert NodeId("n1") not in {i.node for i in group.view().nodes()}
        hb.beat_once()
        infos = {i.node: i for i in group.view().nodes()}
        assert infos[NodeId("n1")].address == "addr-1"
        assert NodeId("n1") in group.view().replicas(b"k" * 16)
    finally:
        store.close()
        group.close()


def test_replicator_copies_only_into_its_own_shards_toward_the_target(tmp_path: Path) -> None:
    group = _group(tmp_path)
    stores = {n: _store(tmp_path, n, group) for n in ("a", "b", "c")}
    try:
        now = time.time()
        for n in stores:
            group.register_node(NodeId(n), n, "prefill", now)
        key, parent = b"x" * 16, b"p" * 16
        stores["a"].shard.put(key, bytes(range(64)), parent, tenant="acme")
        deadline = time.monotonic() + 30
        while group.view().replica_count(key) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        group.set_replica_target(key, 3, now)
        # A process that has only shard b: it reads from nowhere local, no remote reader.
        only_b = Replicator(group.view, {"b": stores["b"].shard})
        assert only_b.run_once(now=now) == 0
        # The process with every shard copies into both missing ones.
        everyone = Replicator(group.view, {n: s.shard for n, s in stores.items()})
        assert everyone.run_once(now=now) == 2
        assert stores["c"].shard.get(key) == bytes(range(64))
        # a replica keeps its owner tenant (the admin views filter on it) and its parent
        for n in ("b", "c"):
            info = stores[n].shard.info(key)
            assert info is not None and (info.tenant, info.parent) == ("acme", parent)
    finally:
        for s in stores.values():
            s.close()
        group.close()


def test_replicator_isolates_a_block_that_fails_and_counts_it(tmp_path: Path) -> None:
    """A source that raises for one block and a value the destination cannot take (another
    size) fail alone: the other block is still copied, each failure is counted by reason in
    the Prometheus metric, and the next pass tries them again."""
    group = _group(tmp_path)
    stores = {n: _store(tmp_path, n, group) for n in ("src", "b")}
    try:
        now = time.time()
        for n in stores:
            group.register_node(NodeId(n), n, "prefill", now)
        raising, too_big, fine = b"r" * 16, b"t" * 16, b"f" * 16
        group.record_batch(
            NodeId("src"), [(k, Tier.DRAM) for k in (raising, too_big, fine)], [], now
        )
        for key in (raising, too_big, fine):
            group.set_replica_target(key, 2, now)

        def remote(source: NodeId, key: bytes) -> BlockCopy | None:
            assert source == "src"
            if key == raising:
                raise RuntimeError("the holder's connection broke mid-read")
            return BlockCopy(bytes(100 if key == too_big else 64), None, "acme")

        metrics = Metrics()
        replicator = Replicator(
            group.view, {"b": stores["b"].shard}, remote, lambda: ["src"], metrics=metrics
        )
        assert replicator.run_once(now=now) == 1
        assert stores["b"].shard.get(fine) == bytes(64)
        assert replicator.failed == 2
        text = metrics.render().decode()
        assert 'kvflow_replicator_failures_total{reason="error"} 1.0' in text
        assert 'kvflow_replicator_failures_total{reason="store"} 1.0' in text
        assert "kvflow_replicator_copies_total 1.0" in text
        deadline = time.monotonic() + 5
        while group.view().replica_count(fine) < 2:  # b's copy reaches the metadata
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert replicator.run_once(now=now) == 0 and replicator.failed == 4  # tried again
    finally:
        for s in stores.values():
            s.close()
        group.close()
