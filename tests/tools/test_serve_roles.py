"""`kvflow serve --role meta` runs a metadata replica that RemoteMetadata can use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kvflow.replication import NodeId, RemoteMetadata, Tier
from kvflow.security import SECRET_FILE_ENV, generate_secret_file
from tests.conftest import pick_free_port


def test_serve_role_meta_single_replica(tmp_path, monkeypatch):
    secret = tmp_path / "given.secret"
    generate_secret_file(secret)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))  # the child's and this client's
    raft, grpc_port, metrics_port = pick_free_port(), pick_free_port(), pick_free_port()
    cmd = [
        sys.executable,
        "-m",
        "kvflow.tools.cli",
        "serve",
        "--role",
        "meta",
        "--address",
        f"127.0.0.1:{raft}",
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--data-dir",
        str(tmp_path),
    ]
    # The child's output goes to a file (a pipe nobody reads can fill and block it); with
    # faulthandler on, SIGABRT dumps its threads there if it does not stop in time.
    log = tmp_path / "meta.log"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        with RemoteMetadata([f"127.0.0.1:{grpc_port}"], timeout_s=20.0) as meta:
            meta.wait_ready(20.0)
            meta.record_batch(NodeId("n0"), [(b"k" * 16, Tier.DRAM)], [])
            assert meta.view().replicas(b"k" * 16) == {"n0": Tier.DRAM}
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(10)
            tail = log.read_text()[-6000:]
            raise AssertionError(f"no exit 20 s after SIGTERM:\n{tail}") from None
        assert code == 0, log.read_text()[-3000:]
        assert (tmp_path / "meta-0").is_dir()  # the journal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
