"""`kvflow cluster` as a user runs it, with the flags docs/cluster.md documents: --host, the
routers' --port and --http-port, --port-base for every other port, --api-key-file handed to
the routers. A real cluster (1 metadata replica, 1 prefill, 1 decode node, 1 router, tiny
model); stopped with Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import pick_free_port

pytestmark = pytest.mark.slow

KEY = "docs-test-admin-key-0123456789"
PORTS = 10  # meta: Raft, gRPC, metrics; 2 nodes: gRPC, transfer, metrics; router: metrics


def _free_range(n: int) -> int:
    """A base port with ``n`` consecutive ports free on 127.0.0.1 a moment ago."""
    for _ in range(50):
        base = pick_free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free range of ports")


def _get(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_cluster_flags(tiny_model: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY} - admin\n")
    keys.chmod(0o600)
    base, grpc, http = _free_range(PORTS), pick_free_port(), pick_free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.tools.cli", "cluster", "--meta", "1", "--prefill", "1",
         "--decode", "1", "--routers", "1", "--model", str(tiny_model), "--host", "127.0.0.1",
         "--port", str(grpc), "--http-port", str(http), "--port-base", str(base),
         "--api-key-file", str(keys), "--data-dir", str(tmp_path / "cluster")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("  Prometheus metrics"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(300) and proc.poll() is None, "\n".join(lines)
        text = "\n".join(lines)
        assert f"routers on 127.0.0.1:{grpc}; metadata on 127.0.0.1:{base + 1}" in text
        assert f"prefill-0: 127.0.0.1:{base + 3}, transfer {base + 4}" in text
        assert f"decode-0: 127.0.0.1:{base + 6}, transfer {base + 7}" in text
        assert (
            f"meta-0={base + 2} prefill-0={base + 5} decode-0={base + 8} router-0={base + 9}"
            in text
        )
        url = f"http://127.0.0.1:{http}/v1/models"
        assert _get(url, None) == 401  # the router got the key file
        assert _get(url, KEY) == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 9}/metrics", timeout=30) as r:
            assert b"kvflow_" in r.read()  # the router's metrics port is base + 9
        models = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(models, timeout=30) as r:
            assert json.load(r)["data"][0]["id"] == tiny_model.name
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert proc.returncode == 0, "\n".join(lines)
