"""PortPicker: the ports of one cluster are distinct even when the OS hands a port out twice."""

from __future__ import annotations

import socket
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


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    low, _ = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert all(max(1024, low - ports.LISTEN_SPAN) <= p < low for p in picked), (low, picked)
    assert len(set(picked)) > 1  # drawn, not one fixed port
    with socket.socket() as sock:  # and each was bindable
        sock.bind(("127.0.0.1", picked[-1]))


def test_ephemeral_range_reads_the_file_or_falls_back(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)


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


def test_port_base_gives_each_process_the_documented_ports(tmp_path: Path) -> None:
    # docs/cluster.md's example: the default cluster with --port-base 7100 (built, not started)
    keys = tmp_path / "keys.txt"
    cluster = LocalCluster(
        tmp_path,
        meta=3,
        prefill=2,
        decode=1,
        routers=2,
        port=50051,
        http_port=8000,
        port_base=7100,
        host="127.0.0.1",
        api_key_file=keys,
    )
    assert cluster.meta_addresses == ["127.0.0.1:7101", "127.0.0.1:7104", "127.0.0.1:7107"]
    assert cluster.node_ports == {"prefill-0": 7109, "prefill-1": 7112, "decode-0": 7115}
    assert cluster.transfer_ports == {"prefill-0": 7110, "prefill-1": 7113, "decode-0": 7116}
    assert cluster.metrics_ports == {
        "meta-0": 7102,
        "meta-1": 7105,
        "meta-2": 7108,
        "prefill-0": 7111,
        "prefill-1": 7114,
        "decode-0": 7117,
        "router-0": 7118,
        "router-1": 7119,
    }
    assert cluster.router_ports == [50051, 50052]
    assert cluster.http_ports == [8000, 8001]
    meta0 = cluster.procs["meta-0"].args
    assert meta0[meta0.index("--address") + 1] == "127.0.0.1:7100"
    assert meta0[meta0.index("--peers") + 1] == "127.0.0.1:7103,127.0.0.1:7106"
    router = cluster.procs["router-1"].args
    assert router[router.index("--api-key-file") + 1] == str(keys)
    assert all(
        "--api-key-file" not in p.args for n, p in cluster.procs.items() if "router" not in n
    )
    assert all(p.args[p.args.index("--host") + 1] == "127.0.0.1" for p in cluster.procs.values())


def test_a_port_base_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--port-base must be 0 or in"):
        LocalCluster(tmp_path, meta=1, prefill=1, decode=1, port_base=80)
    with pytest.raises(ValueError, match="run past 65535"):
        LocalCluster(tmp_path, meta=3, prefill=2, decode=1, port_base=65530)
