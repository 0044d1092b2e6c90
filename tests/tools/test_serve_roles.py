"""`kvflow serve --role meta` runs a metadata replica that RemoteMetadata can use."""

from __future__ import annotations

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
    raft, grpc_port = pick_free_port(), pick_free_port()
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
        "--data-dir",
        str(tmp_path),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with RemoteMetadata([f"127.0.0.1:{grpc_port}"], timeout_s=20.0) as meta:
            meta.wait_ready(20.0)
            meta.record_batch(NodeId("n0"), [(b"k" * 16, Tier.DRAM)], [])
            assert meta.view().replicas(b"k" * 16) == {"n0": Tier.DRAM}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert (tmp_path / "meta-0").is_dir()  # the journal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
