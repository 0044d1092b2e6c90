"""The remote read path between two members on one host: the holder's DRAM tier is a shared
pool, so the reader maps it through the holder's shm socket (transfer/shm_server.py) and
copies each block straight into its buffer, checksummed there (reader.py `_read_mapped`); the
lease and the checksum of every block stay as over tcp."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvflow.kvdb import Tier
from kvflow.transfer import TransferConfig
from tests.kvdb.conftest import NBYTES, value
from tests.kvdb.test_remote_read import Holder, Reader

SAME_HOST = TransferConfig(request_timeout_s=5.0)  # prefer_shm, the default

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")


def test_a_same_host_reader_maps_the_dram_tier_and_still_checks_every_block(
    tmp_path: Path,
) -> None:
    holder = Holder(tmp_path, transfer=SAME_HOST)
    reader = Reader(holder, transfer=SAME_HOST)
    try:
        ks = holder.fill(4)
        assert reader.client.batch_get_into(ks, reader.pages(4)) == [Tier.DRAM] * 4
        assert all(np.array_equal(p, value(i)) for i, p in enumerate(reader.pages(4)))
        segment = next(iter(reader.client._targets.values()))
        assert segment.backend == "shm", segment  # no socket copy

        loose = [bytearray(NBYTES) for _ in range(4)]  # not registered: no staging either
        assert reader.client.batch_get_into(ks, loose) == [Tier.DRAM] * 4
        assert [bytes(b) for b in loose] == [value(i).tobytes() for i in range(4)]
        assert reader.client.stats().staged_bytes == 0

        lease = reader.client.lease(ks)
        holder.shard._state.dram.pool[lease.blocks[1].offset] ^= 0xFF  # bad bytes in DRAM
        got = reader.client.read_into(lease, reader.pages(4))
        assert got == [Tier.DRAM, None, Tier.DRAM, Tier.DRAM]
        assert reader.client.stats().checksum_failures == 1
        reader.client.release(lease)

        lease = reader.client.lease(ks[:1])
        holder.transfer.close()  # the holder's engine goes: its memory is never read again
        reader.pages(1)[0][:] = 0
        assert reader.client.read_into(lease, reader.pages(1)) == [None]
        assert not reader.pages(1)[0].any()
        assert reader.client.stats().transfer_failures == 1  # the block, counted once
    finally:
        reader.close()
        holder.close()
