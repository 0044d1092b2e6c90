"""Prometheus metrics on a registry of their own, and the HTTP endpoint that serves them (with
the ``/healthz`` and ``/readyz`` probes of pipeline/health.py)."""

from __future__ import annotations

import logging
import re
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

from kvflow.pipeline.health import LIVENESS_PATH, READINESS_PATH, Health

logger = logging.getLogger(__name__)

#: Seconds; from 100 µs to 60 s. Suits stage latency, TTFT and TBT alike.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class Metrics:
    """A set of Prometheus metrics with its own ``CollectorRegistry`` (never the global one).

    ``counter``/``gauge``/``histogram`` create a metric named ``<namespace>_<name>`` or return
    the one already made under that name (same kind and labels, else ValueError), so separate
    components can ask for the same series. Thread-safe. ``render()`` is the text format.
    """

    def __init__(self, namespace: str = "kvflow") -> None:
        if not _NAME.match(namespace):
            raise ValueError(f"namespace must match {_NAME.pattern}, got {namespace!r}")
        self.namespace = namespace
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, tuple[str, tuple[str, ...], Any]] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        """A monotonically increasing counter (``_total`` is added to the exposed name)."""
        return self._get(
            "counter",
            name,
            documentation,
            labelnames,
            lambda full, labels: Counter(full, documentation, labels, registry=self.registry),
        )

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """A value that goes up and down (queue depth, in-flight requests, hit rate)."""
        return self._get(
            "gauge",
            name,
            documentation,
            labelnames,
            lambda full, labels: Gauge(full, documentation, labels, registry=self.registry),
        )

    def histogram(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS_S,
    ) -> Histogram:
        """A histogram (TTFT, TBT, stage latency in seconds); ``buckets`` ascending."""
        if not buckets or list(buckets) != sorted(buckets):
            raise ValueError(f"buckets must be a non-empty ascending sequence, got {buckets!r}")
        return self._get(
            "histogram",
            name,
            documentation,
            labelnames,
            lambda full, labels: Histogram(
                full, documentation, labels, registry=self.registry, buckets=tuple(buckets)
            ),
        )

    def render(self) -> bytes:
        """Every metric in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST

    def _get(
        self,
        kind: str,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        make: Callable[[str, tuple[str, ...]], Any],
    ) -> Any:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"metric name must match {_NAME.pattern}, got {name!r}")
        if not documentation:
            raise ValueError(f"metric {name!r}: documentation must be non-empty")
        labels = tuple(labelnames)
        for label in labels:
            if not isinstance(label, str) or not _NAME.match(label):
                raise ValueError(f"metric {name!r}: bad label name {label!r}")
        full = f"{self.namespace}_{name}"
        with self._lock:
            existing = self._metrics.get(full)
            if existing is not None:
                if existing[:2] != (kind, labels):
                    raise ValueError(
                        f"metric {full!r} already exists as {existing[0]} with labels "
                        f"{existing[1]}, not {kind} with {labels}"
                    )
                return existing[2]
            metric = make(full, labels)
            self._metrics[full] = (kind, labels, metric)
            return metric


class PipelineMetrics:
    """The series the pipeline runtime records; made on a ``Metrics`` object.

    - ``pipeline_stage_seconds{stage}``: histogram of time inside ``Stage.run``;
    - ``pipeline_stage_inflight{stage}``: requests inside a stage now;
    - ``pipeline_queue_depth{stage}``: requests waiting in the queue in front of a stage;
    - ``pipeline_stage_errors_total{stage,type}``: failures by stage and error type;
    - ``pipeline_requests_total{status}``: finished requests by status (ok, error, ...);
    - ``pipeline_overloaded_total``: ``try_submit`` refusals;
    - ``pipeline_cleanup_errors_total{stage}``: cleanup hooks that raised or timed out.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.stage_seconds = metrics.histogram(
            "pipeline_stage_seconds", "Time requests spend inside a stage", ["stage"]
        )
        self.inflight = metrics.gauge(
            "pipeline_stage_inflight", "Requests inside a stage now", ["stage"]
        )
        self.queue_depth = metrics.gauge(
            "pipeline_queue_depth", "Requests waiting in the queue in front of a stage", ["stage"]
        )
        self.stage_errors = metrics.counter(
            "pipeline_stage_errors",
            "Requests that failed in a stage, by error type",
            ["stage", "type"],
        )
        self.requests = metrics.counter(
            "pipeline_requests", "Finished requests by status", ["status"]
        )
        self.overloaded = metrics.counter(
            "pipeline_overloaded", "Requests refused by try_submit because the queue was full"
        )
        self.cleanup_errors = metrics.counter(
            "pipeline_cleanup_errors", "Stage cleanup hooks that raised or timed out", ["stage"]
        )

    def track_queue(self, stage: str, depth: Callable[[], float]) -> None:
        """Report ``depth()`` as the queue depth of ``stage`` at every scrape."""
        self.queue_depth.labels(stage).set_function(depth)


@dataclass
class MetricsServer:
    """A running metrics HTTP endpoint; ``close()`` stops it (idempotent)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5.0)
        self._server.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds
        pass


def _app(metrics: Metrics, health: Health) -> Callable[..., Any]:
    """``/healthz`` and ``/readyz``: 200 ``ok`` or 503 with the reason (one line of text);
    every other path: the metrics, as prometheus_client serves them."""
    exposition = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        check = {LIVENESS_PATH: health.liveness, READINESS_PATH: health.readiness}.get(
            environ.get("PATH_INFO", "")
        )
        if check is None:
            return exposition(environ, start_response)
        try:
            reason = check()
        except Exception as exc:  # a check that fails is a failed probe, never a 500 trace
            reason = f"check failed: {type(exc).__name__}"
        status = "200 OK" if reason is None else "503 Service Unavailable"
        body = ("ok" if reason is None else " ".join(reason.split())).encode() + b"\n"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    return app


def serve_metrics(
    metrics: Metrics, host: str = "127.0.0.1", port: int = 0, health: Health | None = None
) -> MetricsServer:
    """Serve ``metrics`` over HTTP (any path but the probes) and ``health`` on ``/healthz``
    and ``/readyz`` (both 200 when None) from a daemon thread; port 0 picks a free one.

    Returns the handle; call ``close()`` to stop serving and release the port.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(
        sockaddr[0], port, _app(metrics, health or Health()), Server, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    bound = int(server.server_address[1])
    logger.info("metrics served on http://%s:%s/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)
