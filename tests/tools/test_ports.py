"""PortPicker: the ports of one cluster are distinct even when the OS hands a port out twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.stages.serve import ports
from kvflow.stages.serve.ports import PortPicker
from kvflow.tools.supervise import LocalCluster


def test_a_port_the_os_gives_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    offers = iter([5001, 5002, 5001, 5002, 5003])  # what bind(0) answered, repeats included
    monkeypatch.setattr(ports, "free_port", lambda host="127.0.0.1": next(offers))
    pick = PortPicker()
    assert [pick(), pick(), pick()] == [5001, 5002, 5003]


def test_every_port_of_a_cluster_is_distinct(tmp_path: Path) -> None:
    # the cluster is built, not started: its constructor picks every port
    cluster = LocalCluster(tmp_path, meta=3, prefill=2, decode=2, routers=2)
    picked = [
        *(int(a.rsplit(":", 1)[1]) for a in cluster.meta_addresses),
        *cluster.node_ports.values(),
        *cluster.router_ports,
        *cluster.http_ports,
        *cluster.metrics_ports.values(),
    ]
    assert len(picked) == len(set(picked)) == 3 + 2 + 2 + 2 + 2 + 9
