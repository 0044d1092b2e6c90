"""SharedLoads: one read per prefix among the requests that want it at the same time; the
buffers go back once, after the last holder; a failed or cancelled reader never takes the
others down with it, and no buffer is left held."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from kvflow.kvdb import Tier
from kvflow.stages.runtime.shared_loads import Read, SharedLoads

WAIT_S = 30.0


class Reader:
    """A read that blocks until ``go`` is set; counts reads and frees."""

    def __init__(self, fail: bool = False) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.reads = 0
        self.freed = 0
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self) -> Read:
        with self._lock:
            self.reads += 1
        self.started.set()
        assert self.go.wait(WAIT_S)
        if self.fail:
            raise OSError("the shard failed")
        return [object()], [Tier.DRAM], self._free

    def _free(self) -> None:
        with self._lock:
            self.freed += 1


async def _until(check: Any) -> None:
    """Wait (on the event loop) until ``check()`` holds, with a generous deadline."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


def test_requests_of_one_prefix_share_one_read_freed_after_the_last() -> None:
    async def main() -> None:
        loads, reader, other = SharedLoads(), Reader(), Reader()
        first = asyncio.ensure_future(loads.load("a", reader))
        await _until(reader.started.is_set)
        second = asyncio.ensure_future(loads.load("a", reader))
        third = asyncio.ensure_future(loads.load("b", other))  # another prefix: its own read
        await _until(other.started.is_set)
        reader.go.set()
        other.go.set()
        (r1, s1, led1), (r2, s2, led2), (_, s3, led3) = await asyncio.gather(first, second, third)
        assert (led1, led2, led3) == (True, False, True)
        assert r1[0] is r2[0] and reader.reads == 1 and other.reads == 1
        assert (loads.reads, loads.joins) == (2, 1)
        later, s4, led4 = await loads.load("a", reader)  # its buffers still held: joins
        assert not led4 and later[0] is r1[0]
        for share in (s1, s2, s1):  # a second release of one hold changes nothing
            share.release()
        assert reader.freed == 0 and loads.held() == 2
        s4.release()
        s3.release()
        assert reader.freed == 1 and other.freed == 1 and loads.held() == 0
        reader.go.clear()
        (_, s5, led5), _ = await asyncio.gather(
            loads.load("a", reader), asyncio.to_thread(reader.go.set)
        )
        assert led5 and reader.reads == 2  # nobody held it: read again
        s5.release()
        assert reader.freed == 2

    asyncio.run(main())


def test_a_failed_read_fails_its_reader_and_the_followers_read_for_themselves() -> None:
    async def main() -> None:
        loads, bad = SharedLoads(), Reader(fail=True)
        first = asyncio.ensure_future(loads.load("a", bad))
        await _until(bad.started.is_set)
        good = Reader()
        good.go.set()
        second = asyncio.ensure_future(loads.load("a", good))
        await _until(lambda: loads.held() == 1 and loads._flights["a"].holders == 2)
        bad.go.set()  # the second follows the read that fails
        with pytest.raises(OSError, match="the shard failed"):
            await first
        read, share, led = await second
        assert led and good.reads == 1 and read[1] == [Tier.DRAM]
        assert (loads.reads, loads.joins) == (2, 0)  # it read for itself: no join
        share.release()
        assert good.freed == 1 and bad.freed == 0 and loads.held() == 0

    asyncio.run(main())


def test_a_cancelled_reader_leaves_the_read_to_the_others_and_nothing_held() -> None:
    async def main() -> None:
        loads, reader = SharedLoads(), Reader()
        first = asyncio.ensure_future(loads.load("a", reader))
        await _until(reader.started.is_set)
        second = asyncio.ensure_future(loads.load("a", reader))
        await _until(lambda: loads._flights["a"].holders == 2)
        first.cancel()  # the leader's client went away: the follower still gets the read
        with pytest.raises(asyncio.CancelledError):
            await first
        reader.go.set()
        _, share, led = await second
        assert not led and reader.reads == 1 and reader.freed == 0
        share.release()
        assert reader.freed == 1

        # every holder cancelled while the read runs: freed when it ends
        reader.go.clear()
        started = reader.reads
        alone = asyncio.ensure_future(loads.load("a", reader))
        await _until(lambda: reader.reads > started)
        alone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await alone
        assert loads.held() == 0 and reader.freed == 1
        reader.go.set()
        await _until(lambda: reader.freed == 2)

    asyncio.run(main())
