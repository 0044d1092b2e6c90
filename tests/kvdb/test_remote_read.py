"""The remote read path: a holder (shard + BlockService + TransferEngine server) and a reader
(its own TransferEngine + RemoteClient) in one process, bytes moving over real tcp."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvflow.kvdb import (
    BLOCK_SERVICE_NAME,
    BlockServer,
    BlockServiceConfig,
    NodeId,
    PeerCallBudget,
    RemoteClient,
    RemoteClientConfig,
    RemoteReadError,
    Shard,
    ShardRef,
    StaticAdminSource,
    Tier,
    ValueSizeError,
    add_block_service,
)
from kvflow.kvdb.proto import pb2, pb2_grpc
from kvflow.transfer import TransferConfig, TransferEngine
from tests.conftest import pick_free_port
from tests.kvdb.conftest import NAMESPACE, NBYTES, config, keys, value

TCP = TransferConfig(prefer_shm=False, request_timeout_s=5.0)


class Holder:
    """One node: shards, a transfer engine serving their DRAM pools, a gRPC BlockService."""

    def __init__(
        self,
        tmp_path: Path,
        shard_ids: tuple[str, ...] = ("s0",),
        transfer: TransferConfig = TCP,
        **service: Any,
    ) -> None:
        self.shards = {
            sid: Shard(
                config(tmp_path, data_dir=tmp_path / sid, engine="rocksdb"),
                NAMESPACE.fingerprint(),
                shuffle_bytes=2,
            )
            for sid in shard_ids
        }
        self.shard = next(iter(self.shards.values()))
        self.transfer = TransferEngine(transfer)
        self.transfer.start_server()
        source = StaticAdminSource(
            {sid: ShardRef(s, NodeId("holder"), "prefill") for sid, s in self.shards.items()}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.blocks = add_block_service(
            self.server, source, self.transfer, BlockServiceConfig(**service)
        )
        port = pick_free_port()
        self.address = f"127.0.0.1:{port}"
        assert self.server.add_insecure_port(self.address) == port
        self.server.start()

    def fill(self, n: int) -> list[bytes]:
        ks = keys(n)
        for i, k in enumerate(ks):
            parent = ks[i - 1] if i else None
            assert self.shard.put(k, value(i), parent, tenant="tenant-a") is Tier.DRAM
        return ks

    def close(self) -> None:
        self.server.stop(None).wait()
        self.blocks.close()
        self.transfer.close()
        for shard in self.shards.values():
            shard.close()


class Reader:
    def __init__(self, holder: Holder, transfer: TransferConfig = TCP, **cfg: Any) -> None:
        # these tests check what a read returns, not its deadlines (the tests of hung holders
        # bring their own budgets): the default 0.5 s lease deadline failed on a loaded box
        cfg.setdefault("budget", PeerCallBudget(base_s=10.0))
        self.transfer = TransferEngine(transfer)
        self.client = RemoteClient(
            holder.address,
            self.transfer,
            holder.transfer.peer_address,
            config=RemoteClientConfig(**cfg),
        )
        self.pool = np.zeros(8 * NBYTES, dtype=np.uint8)  # "KV pages", registered once
        self.client.register_destination(self.pool)

    def pages(self, n: int) -> list[np.ndarray]:
        return [self.pool[i * NBYTES : (i + 1) * NBYTES] for i in range(n)]

    def close(self) -> None:
        self.client.close()
        self.transfer.close()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    h = Holder(tmp_path)
    yield h
    h.close()


@pytest.fixture
def reader(holder: Holder) -> Iterator[Reader]:
    r = Reader(holder)
    yield r
    r.close()


def test_batch_get_into_registered_pages_is_direct(holder: Holder, reader: Reader) -> None:
    ks = holder.fill(6)
    wanted = ks + keys(8)[6:]  # two keys the holder lacks
    got = reader.client.batch_get_into(wanted, reader.pages(8))
    assert got == [Tier.DRAM] * 6 + [None, None]
    for i, page in enumerate(reader.pages(6)):
        assert np.array_equal(page, value(i))
    stats = reader.client.stats()
    assert (stats.hits, stats.misses, stats.staged_bytes) == (6, 2, 0)
    assert stats.bytes_read == 6 * NBYTES and stats.leases == 1
    reader.client.wait_released()  # batch_get_into releases without waiting
    assert holder.shard.num_pinned() == 0 and len(holder.blocks.leases) == 0
    assert holder.shard.stats().dram.hits == 6


def _slices(reader: Reader) -> int:
    return sum(s.slices for s in reader.transfer.backend("tcp").endpoint_stats().values())


def test_adjacent_blocks_into_adjacent_pages_move_as_one_request(
    holder: Holder, reader: Reader
) -> None:
    """Blocks back to back in the holder's pool, read into back-to-back pages: one transfer
    request (read_plan); checksums stay per block."""
    ks = holder.fill(6)
    assert reader.client.batch_get_into(ks, reader.pages(6)) == [Tier.DRAM] * 6
    assert all(np.array_equal(p, value(i)) for i, p in enumerate(reader.pages(6)))
    assert _slices(reader) == 1
    pages = reader.pages(8)
    scattered = [pages[7], pages[5], pages[3]]  # not adjacent: one request each
    assert reader.client.batch_get_into(ks[:3], scattered) == [Tier.DRAM] * 3
    assert all(np.array_equal(p, value(i)) for i, p in enumerate(scattered))
    assert _slices(reader) == 1 + 3


def test_a_corrupt_block_inside_a_run_is_the_only_miss(holder: Holder, reader: Reader) -> None:
    ks = holder.fill(4)
    lease = reader.client.lease(ks)
    pool = holder.shard._state.dram.pool  # flip a byte of the third block, inside the run
    pool[lease.blocks[2].offset] ^= 0xFF
    assert reader.client.read_into(lease, reader.pages(4)) == [Tier.DRAM] * 2 + [None, Tier.DRAM]
    assert reader.client.stats().checksum_failures == 1
    assert _slices(reader) == 1
    reader.client.release(lease)


def test_unregistered_buffers_go_through_staging_in_rounds(holder: Holder) -> None:
    reader = Reader(holder, staging_bytes=2 * NBYTES)  # 6 blocks: 3 staged rounds
    try:
        ks = holder.fill(6)
        bufs = [bytearray(NBYTES) for _ in range(5)] + [reader.pages(1)[0]]  # last: direct
        assert reader.client.batch_get_into(ks, bufs) == [Tier.DRAM] * 6
        for i, buf in enumerate(bufs):
            assert bytes(buf) == value(i).tobytes()
        assert reader.client.stats().staged_bytes == 5 * NBYTES
    finally:
        reader.close()


def test_ssd_blocks_are_promoted_for_the_lease(holder: Holder, reader: Reader) -> None:
    ks = holder.fill(4)
    holder.shard.evict(Tier.DRAM, 2 * NBYTES)
    assert [holder.shard.tier_of(k) for k in ks] == [Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.SSD]
    got = reader.client.batch_get_into(ks, reader.pages(4))
    assert got == [Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.SSD]  # the tier before the lease
    assert all(np.array_equal(p, value(i)) for i, p in enumerate(reader.pages(4)))
    assert [holder.shard.tier_of(k) for k in ks] == [Tier.DRAM] * 4
    assert holder.shard.stats().ssd.promotions == 2


def test_a_lease_reports_each_blocks_parent_and_owner(holder: Holder, reader: Reader) -> None:
    """What a copy of a remote block needs to keep (the replicator's remote source)."""
    ks = holder.fill(2)
    lease = reader.client.lease(ks)
    try:
        assert [(b.parent, b.tenant) for b in lease.blocks] == [
            (None, "tenant-a"),
            (ks[0], "tenant-a"),
        ]
    finally:
        reader.client.release(lease)


def test_lease_covers_only_the_leading_run(holder: Holder, reader: Reader) -> None:
    ks = holder.fill(3)
    holder.shard.remove(ks[1])
    assert reader.client.batch_get_into(ks, reader.pages(3)) == [Tier.DRAM, None, None]
    lease = reader.client.lease(keys(5)[3:])  # nothing held
    assert lease.lease_id == 0 and lease.blocks == ()
    assert reader.client.release(lease) is False


def test_block_evicted_and_overwritten_after_lease_is_a_miss(
    holder: Holder, reader: Reader
) -> None:
    ks = holder.fill(3)
    lease = reader.client.lease(ks)
    assert [b.length for b in lease.blocks] == [NBYTES] * 3
    assert reader.client.release(lease) is True  # e.g. the lease lapsed under a slow reader
    holder.shard.evict(Tier.DRAM, 8 * NBYTES)  # all three demoted: their extents are free
    others = keys(3, tenant="tenant-b")
    for i, k in enumerate(others):  # first fit: the same extents, other bytes
        holder.shard.put(k, value(100 + i))
    staged = [bytearray(b"\x07" * NBYTES) for _ in range(2)]
    got = reader.client.read_into(lease, [reader.pages(1)[0], *staged])
    assert got == [None, None, None]
    assert reader.client.stats().checksum_failures == 3
    assert all(bytes(b) == b"\x07" * NBYTES for b in staged)  # staged misses: untouched


def test_failed_transfer_is_a_miss(holder: Holder, reader: Reader) -> None:
    ks = holder.fill(2)
    lease = reader.client.lease(ks)
    holder.blocks.close()  # unregisters the DRAM segment, drops the lease's pins
    assert holder.shard.num_pinned() == 0
    assert reader.client.read_into(lease, reader.pages(2)) == [None, None]
    assert reader.client.stats().transfer_failures == 2
    assert reader.client.release(lease) is False


def test_lease_timeout_releases_pins(tmp_path: Path) -> None:
    holder = Holder(tmp_path, lease_timeout_s=0.2, reap_interval_s=0.02)
    reader = Reader(holder)
    try:
        ks = holder.fill(3)
        lease = reader.client.lease(ks)  # a reader that dies before Release
        assert holder.shard.num_pinned() == 3 and lease.timeout_s == pytest.approx(0.2)
        deadline = time.monotonic() + 10
        while holder.shard.num_pinned() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert holder.shard.num_pinned() == 0
        assert holder.blocks.leases.expired == 1
        assert reader.client.release(lease) is False
        assert holder.shard.evict(Tier.DRAM, 3 * NBYTES) == 3  # evictable again
    finally:
        reader.close()
        holder.close()


def test_expiry_with_a_hand_driven_clock(tmp_path: Path) -> None:
    now = [100.0]
    shard = Shard(config(tmp_path), NAMESPACE.fingerprint(), shuffle_bytes=2)
    ks = keys(2)
    for i, k in enumerate(ks):
        shard.put(k, value(i))
    with TransferEngine(TCP) as transfer:
        source = StaticAdminSource({"s": ShardRef(shard, NodeId("n"), "prefill")})
        server = BlockServer(
            source,
            transfer,
            BlockServiceConfig(lease_timeout_s=5),
            clock=lambda: now[0],
            reaper=False,
        )
        try:
            first = server.Lease(pb2.LeaseRequest(keys=ks[:1]))
            now[0] = 103.0
            second = server.Lease(pb2.LeaseRequest(keys=ks))
            assert (first.lease_id, second.lease_id) == (1, 2)
            assert shard.num_pinned() == 2 and shard.release_dram([]) == 0
            assert server.expire(104.9) == 0 and server.expire(105.0) == 1
            assert shard.num_pinned() == 2  # ks[0] still pinned once by the second lease
            assert server.expire(108.0) == 1 and shard.num_pinned() == 0
            assert transfer.registered() == ["kvdb-dram:s"]
        finally:
            server.close()
        assert transfer.registered() == []
    shard.close()


# ----------------------------------------------------------------------------- bad input


def test_block_service_bad_input(tmp_path: Path) -> None:
    holder = Holder(tmp_path, ("a", "b"))
    try:
        with grpc.insecure_channel(holder.address) as channel:
            stub = pb2_grpc.BlockServiceStub(channel)
            cases = [
                (pb2.LeaseRequest(shard="a", keys=[b"short"]), "INVALID_ARGUMENT", "keys[0] has 5"),
                (pb2.LeaseRequest(keys=keys(1)), "INVALID_ARGUMENT", "shard is required"),
                (pb2.LeaseRequest(shard="zz", keys=keys(1)), "NOT_FOUND", "no shard 'zz'"),
            ]
            for request, code, words in cases:
                with pytest.raises(grpc.RpcError) as info:
                    stub.Lease(request, timeout=5)
                assert info.value.code().name == code and words in info.value.details()
            reply = stub.Release(pb2.ReleaseRequest(lease_id=12345), timeout=5)
            assert not reply.released
    finally:
        holder.close()
    assert BLOCK_SERVICE_NAME == "kvflow.kvdb.v1.BlockService"


def test_too_many_keys_is_invalid(tmp_path: Path) -> None:
    holder = Holder(tmp_path, max_keys=2)
    reader = Reader(holder)
    try:
        with pytest.raises(RemoteReadError, match=r"INVALID_ARGUMENT.*at most 2 keys"):
            reader.client.lease(keys(3))
    finally:
        reader.close()
        holder.close()


def test_client_side_errors(holder: Holder, reader: Reader) -> None:
    ks = holder.fill(2)
    with pytest.raises(ValueSizeError, match="bufs\\[1\\] has 10 bytes"):
        reader.client.batch_get_into(ks, [reader.pages(1)[0], bytearray(10)])
    reader.client.wait_released()
    assert holder.shard.num_pinned() == 0  # the lease was released anyway
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        reader.client.batch_get_into(ks, reader.pages(1))
    with pytest.raises(ValueError, match="16 bytes"):
        reader.client.batch_get_into([b"x"], reader.pages(1))
    assert reader.client.batch_get_into([], []) == []


def test_unreachable_holder_raises_remote_read_error() -> None:
    with TransferEngine(TCP) as transfer:
        client = RemoteClient(
            f"127.0.0.1:{pick_free_port()}",
            transfer,
            "127.0.0.1:1",
            config=RemoteClientConfig(budget=PeerCallBudget(base_s=0.5)),
        )
        with client, pytest.raises(RemoteReadError, match=r"Lease to .* failed"):
            client.batch_get_into(keys(1), [bytearray(NBYTES)])


def test_configs_validate() -> None:
    with pytest.raises(ValueError, match="lease_timeout_s"):
        BlockServiceConfig(lease_timeout_s=0)
    with pytest.raises(ValueError, match="max_keys"):
        BlockServiceConfig(max_keys=0)
    with pytest.raises(ValueError, match="staging_bytes"):
        RemoteClientConfig(staging_bytes=0)
    with pytest.raises(ValueError, match="budget"):
        RemoteClientConfig(budget=5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_s"):
        PeerCallBudget(base_s=-1)
