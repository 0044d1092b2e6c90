"""The admission queue on its own: FIFO within a priority, interactive before warm-up, the
bounds (requests, tokens, time) refusing with the limit's name, a cancelled waiter's place
given back, and the running limit that drops on "no room" and climbs back on success."""

from __future__ import annotations

import asyncio

import pytest

from kvflow.pipeline import AdmissionConfig, AdmissionQueue, Metrics, Priority, QueueFull
from tests.pipeline.conftest import run_async, spin


def queue(**kw: object) -> AdmissionQueue:
    return AdmissionQueue(AdmissionConfig(**kw), Metrics())  # type: ignore[arg-type]


def test_order_and_release() -> None:
    """max_running 1: each release lets exactly the next one in, in priority/arrival order."""

    async def main() -> list[str]:
        q = queue(max_running=1)
        first = q.ticket(1)
        await q.wait(first)
        order: list[str] = []
        tickets: dict[str, object] = {}

        async def one(name: str, prio: Priority) -> None:
            t = q.ticket(1, prio)
            tickets[name] = t
            await q.wait(t)
            order.append(name)

        names = [("w1", Priority.WARMUP), ("i1", Priority.INTERACTIVE)]
        names += [("w2", Priority.WARMUP), ("i2", Priority.INTERACTIVE)]
        tasks = [asyncio.create_task(one(n, p)) for n, p in names]
        await spin()
        assert q.waiting() == 4 and q.waiting(Priority.WARMUP) == 2
        q.release(first)
        for _ in range(4):
            await spin()
            assert q.running() == 1
            q.release(tickets[order[-1]])  # type: ignore[arg-type]
        await asyncio.gather(*tasks)
        assert q.running() == 0 and q.waiting() == 0
        return order

    assert run_async(main()) == ["i1", "i2", "w1", "w2"]


def test_full_queue_names_the_limit() -> None:
    async def main() -> None:
        q = queue(max_running=1, max_queued_requests=2)
        await q.wait(q.ticket(1))
        tasks = [asyncio.create_task(q.wait(q.ticket(1))) for _ in range(2)]
        await spin()
        with pytest.raises(QueueFull) as err:
            await q.wait(q.ticket(1))
        assert err.value.limit == "max_queued_requests"
        assert "max_queued_requests 2" in str(err.value)
        assert err.value.retry_after_s >= 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert q.waiting() == 0

    run_async(main())


def test_token_bound() -> None:
    async def main() -> None:
        q = queue(max_running=1, max_queued_tokens=100)
        await q.wait(q.ticket(1))
        waiting = asyncio.create_task(q.wait(q.ticket(60)))
        await spin()
        with pytest.raises(QueueFull) as err:
            await q.wait(q.ticket(50))
        assert err.value.limit == "max_queued_tokens" and "max_queued_tokens 100" in str(err.value)
        assert q.waiting_tokens() == 60
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert q.waiting_tokens() == 0
        big = asyncio.create_task(q.wait(q.ticket(500)))  # alone it may wait
        await spin()
        assert q.waiting() == 1
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)

    run_async(main())


def test_cancelled_waiter_frees_its_place() -> None:
    async def main() -> None:
        q = queue(max_running=1, max_queued_requests=1)
        held = q.ticket(1)
        await q.wait(held)
        gone = asyncio.create_task(q.wait(q.ticket(1)))
        await spin()
        assert q.waiting() == 1
        gone.cancel()  # the client went away
        await asyncio.gather(gone, return_exceptions=True)
        assert q.waiting() == 0
        nxt = q.ticket(1)
        later = asyncio.create_task(q.wait(nxt))  # its place is free again
        await spin()
        q.release(held)
        await later
        assert nxt.held and q.running() == 1

    run_async(main())


def test_queue_timeout() -> None:
    async def main() -> None:
        q = queue(max_running=1, queue_timeout_s=0.05)
        await q.wait(q.ticket(1))
        with pytest.raises(QueueFull) as err:
            await q.wait(q.ticket(1))
        assert err.value.limit == "queue_timeout_s"
        assert q.waiting() == 0

    run_async(main())


def test_no_room_lowers_the_limit_and_keeps_the_place() -> None:
    async def main() -> None:
        q = queue(max_running=4)
        a, b, c = q.ticket(1), q.ticket(1), q.ticket(1)
        for t in (a, b, c):
            await q.wait(t)
        q.no_room(c)  # c was admitted but the engine had no pages
        assert q.limit() == 2 and q.running() == 2
        late = q.ticket(1)
        late_task = asyncio.create_task(q.wait(late))
        retry = asyncio.create_task(q.wait(c))  # c waits again, ahead of the later arrival
        await spin()
        assert not c.held and not late.held
        q.release(a)  # room again: the head (c, by its first arrival) goes first
        await spin()
        assert c.held and not late.held
        assert q.limit() == 2  # a ended well: +1/2
        await spin()
        q.release(b)
        await asyncio.gather(retry, late_task)
        assert late.held and c.retries == 1

    run_async(main())


def test_no_room_with_nothing_running_backs_off() -> None:
    async def main() -> None:
        q = queue(max_running=2, backoff_s=0.02)
        t = q.ticket(1)
        await q.wait(t)
        q.no_room(t)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await q.wait(t)  # nothing runs: admitted again after the backoff, not at once
        assert loop.time() - start >= 0.015
        assert t.held

    run_async(main())


def test_metrics_exposed() -> None:
    async def main() -> bytes:
        m = Metrics()
        q = AdmissionQueue(AdmissionConfig(max_running=1), m)
        t = q.ticket(3)
        await q.wait(t)
        q.release(t)
        return m.render()

    text = run_async(main()).decode()
    for name in (
        "kvflow_admission_queue_seconds_bucket",
        "kvflow_admission_waiting_requests",
        "kvflow_admission_running_limit",
    ):
        assert name in text


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        AdmissionConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="queue_timeout_s"):
        AdmissionConfig(queue_timeout_s=0)
