"""gRPC's largest message is derived from the prompt limit: `kvflow serve` (a process of its
own, so its memory is its own) refuses a 60 MB prompt with RESOURCE_EXHAUSTED before it is
allocated (its RSS barely moves), and still serves."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvflow.stages.api import pb2, pb2_grpc
from kvflow.stages.api.limits import MESSAGE_OVERHEAD_BYTES, max_message_bytes
from tests.conftest import pick_free_port


def test_limit_is_derived_from_the_prompt_limit() -> None:
    assert max_message_bytes(1 << 20, 2048) == (1 << 20) + MESSAGE_OVERHEAD_BYTES
    assert max_message_bytes(1 << 10, 100_000) == 500_000 + MESSAGE_OVERHEAD_BYTES  # token ids
    assert max_message_bytes(1 << 20, 2048, upload_bytes=8 << 20) == 8 << 20


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_oversized_message_refused_before_allocation(tiny_model: Path, tmp_path: Path) -> None:
    port = pick_free_port()
    cmd = [
        sys.executable, "-m", "kvflow.tools.cli", "serve", "--model", str(tiny_model),
        "--data-dir", str(tmp_path), "--port", str(port), "--http-port", "0",
        "--metrics-port", "0", "--block-size", "16", "--num-pages", "64",
        "--dram-mb", "16", "--max-upload-bytes", "1",
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 128 << 20)]
        ) as channel:
            stub = pb2_grpc.InferenceStub(channel)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if stub.Health(pb2.HealthRequest(), timeout=2).serving:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
            before = rss_kb(proc.pid)
            huge = pb2.GenerateRequest(prompt="x" * (60 << 20), max_tokens=2)
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(huge, timeout=60))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            del huge
            grown_mb = (rss_kb(proc.pid) - before) / 1024
            assert grown_mb < 30, f"server RSS grew {grown_mb:.0f} MB for refused messages"
            ok = pb2.GenerateRequest(prompt="still serving", max_tokens=2)
            assert sum(len(m.token_ids) for m in stub.Generate(ok, timeout=60)) >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
