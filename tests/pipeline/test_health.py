"""The probes on the metrics port (``/healthz``, ``/readyz``), the per-role readiness checks
of pipeline/health.py, and the admission queue's close for a drain."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from kvflow.pipeline import (
    AdmissionConfig,
    AdmissionQueue,
    Health,
    LoopPulse,
    Metrics,
    PipelineClosed,
    serve_metrics,
)
from kvflow.pipeline.health import frontend_ready, meta_ready, node_ready


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_probes_answer_next_to_the_metrics() -> None:
    metrics = Metrics()
    metrics.counter("probe_test", "a series").inc()
    state: dict[str, str | None] = {"live": None, "ready": "no healthy decode node"}
    health = Health(live=lambda: state["live"], ready=lambda: state["ready"])
    server = serve_metrics(metrics, "127.0.0.1", 0, health)
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert get(f"{base}/healthz") == (200, "ok\n")
        assert get(f"{base}/readyz") == (503, "no healthy decode node\n")
        state["ready"] = None
        assert get(f"{base}/readyz") == (200, "ok\n")
        health.draining = True  # a graceful stop: out of the Service, not restarted
        assert get(f"{base}/readyz") == (503, "draining\n")
        assert get(f"{base}/healthz") == (200, "ok\n")
        state["live"] = "event loop stalled for 31 s"
        assert get(f"{base}/healthz") == (503, "event loop stalled for 31 s\n")
        status, body = get(f"{base}/metrics")
        assert status == 200 and "kvflow_probe_test_total 1.0" in body
    finally:
        server.close()


def test_a_check_that_raises_is_a_failed_probe_without_a_trace() -> None:
    def broken() -> str | None:
        raise RuntimeError("secret detail")

    server = serve_metrics(Metrics(), "127.0.0.1", 0, Health(ready=broken))
    try:
        assert get(f"http://127.0.0.1:{server.port}/readyz") == (
            503,
            "check failed: RuntimeError\n",
        )
        assert get(f"http://127.0.0.1:{server.port}/healthz") == (200, "ok\n")  # default
    finally:
        server.close()


def test_loop_pulse_fails_once_the_loop_stops_ticking() -> None:
    now = [100.0]
    pulse = LoopPulse(stale_s=30.0, clock=lambda: now[0])
    assert pulse.check() is None
    now[0] += 29.0
    assert pulse.check() is None
    now[0] += 2.0
    assert pulse.check() == "event loop stalled for 31 s"

    async def tick() -> None:
        task = asyncio.get_running_loop().create_task(pulse.run())
        await asyncio.sleep(0)
        task.cancel()

    asyncio.run(tick())
    assert pulse.check() is None


def test_node_readiness_needs_a_running_pipeline_and_a_recent_heartbeat() -> None:
    import time

    node = SimpleNamespace(
        pipeline=SimpleNamespace(running=True), heartbeat=SimpleNamespace(last_ok=None)
    )
    check = node_ready(node, stale_s=10.0)
    assert check() == "not registered with the metadata group"
    node.heartbeat.last_ok = time.monotonic()
    assert check() is None
    node.heartbeat.last_ok = time.monotonic() - 11.0
    assert check() == "no heartbeat taken by the metadata group for 10 s"
    node.heartbeat.last_ok = time.monotonic()
    node.pipeline.running = False
    assert check() == "pipeline not running"


def test_router_readiness_needs_a_healthy_prefill_and_decode_node() -> None:
    def instance(healthy: bool) -> SimpleNamespace:
        return SimpleNamespace(state=SimpleNamespace(healthy=healthy))

    router = SimpleNamespace(pipeline=SimpleNamespace(running=True), prefill={}, decode={})
    check = frontend_ready(router)
    assert check() == "no healthy prefill node"
    router.prefill["p0"] = instance(True)
    assert check() == "no healthy decode node"
    router.decode["d0"] = instance(False)
    assert check() == "no healthy decode node"
    router.decode["d1"] = instance(True)
    assert check() is None


def test_meta_readiness_is_the_groups_ready_state() -> None:
    ready = [False]
    check = meta_ready(SimpleNamespace(is_ready=lambda: ready[0]))
    assert check() == "no leader known or not caught up"
    ready[0] = True
    assert check() is None


def test_a_closed_admission_queue_refuses_new_requests_and_lets_the_admitted_end() -> None:
    async def scenario() -> None:
        queue = AdmissionQueue(AdmissionConfig(max_running=1))
        running = await queue.wait(queue.ticket(10))
        waiting = asyncio.get_running_loop().create_task(queue.wait(queue.ticket(10)))
        await asyncio.sleep(0)
        assert queue.waiting() == 1 and not queue.idle()
        queue.close("draining: test")
        assert queue.closed
        with pytest.raises(PipelineClosed, match="not admitting new requests: draining: test"):
            await queue.wait(queue.ticket(10))
        queue.release(running)
        second = await asyncio.wait_for(waiting, timeout=10)  # queued before close: runs
        assert not queue.idle()
        queue.release(second)
        assert queue.idle()

    asyncio.run(scenario())
