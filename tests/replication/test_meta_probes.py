"""A metadata replica's probes on its metrics port (what `kvflow serve --role meta` serves):
``/readyz`` is 503 until the replica knows a leader and caught up, 200 then, 503 again once
closed; ``/healthz`` fails once the replica is told to stop."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

from kvflow.replication import MetadataConfig, MetadataGroup
from kvflow.tools.meta import _serve_metrics
from tests.conftest import pick_free_port


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_meta_readiness_follows_the_groups_state(single_config: MetadataConfig) -> None:
    group = MetadataGroup(single_config)
    stop = threading.Event()
    server = _serve_metrics(group, "127.0.0.1", pick_free_port(), stop)
    assert server is not None
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert get(f"{base}/readyz") == (503, "no leader known or not caught up\n")
        assert get(f"{base}/healthz") == (200, "ok\n")
        group.start()
        group.wait_ready(timeout=30.0)
        assert get(f"{base}/readyz") == (200, "ok\n")
        status, body = get(f"{base}/metrics")
        assert status == 200 and "kvflow_meta_is_leader 1.0" in body
        stop.set()
        assert get(f"{base}/healthz") == (503, "stopping\n")
        group.close()
        assert get(f"{base}/readyz") == (503, "no leader known or not caught up\n")
    finally:
        server.close()
        group.close()
