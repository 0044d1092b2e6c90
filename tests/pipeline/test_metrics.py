"""Metrics on their own registry, the runtime's series, and the HTTP endpoint."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

import pytest
from prometheus_client import REGISTRY

from kvflow.pipeline import (
    FunctionStage,
    Metrics,
    Pipeline,
    RequestContext,
    serve_metrics,
)

from .conftest import run_async


def test_helpers_create_once_and_refuse_conflicts() -> None:
    metrics = Metrics()
    hits = metrics.counter("kvdb_hits", "Block hits by tier", ["tier"])
    assert metrics.counter("kvdb_hits", "Block hits by tier", ["tier"]) is hits
    with pytest.raises(ValueError, match="already exists as counter"):
        metrics.gauge("kvdb_hits", "x", ["tier"])
    with pytest.raises(ValueError, match="already exists"):
        metrics.counter("kvdb_hits", "x", ["node"])
    with pytest.raises(ValueError, match="metric name"):
        metrics.counter("bad-name", "x")
    with pytest.raises(ValueError, match="label"):
        metrics.gauge("g", "x", ["bad-label"])
    with pytest.raises(ValueError, match="buckets"):
        metrics.histogram("h", "x", buckets=[2.0, 1.0])
    with pytest.raises(ValueError, match="namespace"):
        Metrics("bad ns")
    hits.labels("dram").inc(3)
    metrics.gauge("hit_rate", "Hit rate", ["tier"]).labels("ssd").set(0.25)
    ttft = metrics.histogram("ttft_seconds", "Time to first token")
    ttft.observe(0.3)
    text = metrics.render().decode()
    assert 'kvflow_kvdb_hits_total{tier="dram"} 3.0' in text
    assert 'kvflow_hit_rate{tier="ssd"} 0.25' in text
    assert 'kvflow_ttft_seconds_bucket{le="0.5"} 1.0' in text
    assert 'kvflow_ttft_seconds_bucket{le="0.25"} 0.0' in text
    assert REGISTRY.get_sample_value("kvflow_kvdb_hits_total", {"tier": "dram"}) is None
    # two Metrics objects never collide
    Metrics().counter("kvdb_hits", "Block hits by tier", ["tier"])


def test_runtime_records_its_series() -> None:
    async def work(ctx: RequestContext[Any]) -> None:
        await asyncio.sleep(0)

    async def main() -> Metrics:
        metrics = Metrics(namespace="t")
        stages = [FunctionStage("tokenize", work), FunctionStage("decode", work)]
        async with Pipeline(stages, metrics=metrics) as pipe:
            for i in range(3):
                await (await pipe.submit(RequestContext(f"r{i}"))).result()
        return metrics

    text = run_async(main()).render().decode()
    for stage in ("tokenize", "decode"):
        assert f't_pipeline_stage_seconds_count{{stage="{stage}"}} 3.0' in text
        assert f't_pipeline_stage_inflight{{stage="{stage}"}} 0.0' in text
        assert f't_pipeline_queue_depth{{stage="{stage}"}} 0.0' in text
    assert 't_pipeline_requests_total{status="ok"} 3.0' in text
    assert "t_pipeline_overloaded_total 0.0" in text


def test_metrics_http_endpoint_serves_text_and_closes() -> None:
    metrics = Metrics()
    metrics.counter("requests", "Requests").inc(7)
    server = serve_metrics(metrics, port=0)
    try:
        assert server.port > 0 and server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url, timeout=5) as response:
            body = response.read().decode()
            content_type = response.headers["Content-Type"]
        assert "kvflow_requests_total 7.0" in body
        assert content_type.startswith("text/plain")
    finally:
        server.close()
    server.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=1)
    with pytest.raises(ValueError, match="port"):
        serve_metrics(metrics, port=70000)


def test_serve_metrics_on_a_given_free_port(free_port: int) -> None:
    server = serve_metrics(Metrics(), host="127.0.0.1", port=free_port)
    try:
        assert server.port == free_port
    finally:
        server.close()
