"""submit(deadline_s=...): a caller's deadline sized to its bytes ends a request to a hung
peer (a PausableProxy holding every byte) at that deadline, not at the engine's
request_timeout_s; bad deadlines are refused by name."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvflow.transfer import OpCode, TransferRequest, TransferState
from tests.pausable_proxy import PausableProxy
from tests.transfer.conftest import EngineFactory


def test_a_deadline_ends_a_read_from_a_hung_peer(make_engine: EngineFactory) -> None:
    server = make_engine(prefer_shm=False)
    server.register_memory("seg", np.arange(4096, dtype=np.uint8))
    host, port = server.start_server()
    proxy = PausableProxy(f"{host}:{port}")
    try:
        client = make_engine(prefer_shm=False, request_timeout_s=10.0)
        local = np.zeros(4096, dtype=np.uint8)
        client.register_memory("dst", local)
        target = client.open_segment(proxy.address, "seg")
        read = [TransferRequest(OpCode.READ, "dst", 0, target, 0, 4096)]
        assert client.transfer(read)[0].ok  # the connection is up
        proxy.paused.set()
        t0 = time.monotonic()
        status = client.transfer(read, 5.0, deadline_s=0.3)[0]
        took = time.monotonic() - t0
        assert status.state is TransferState.TIMEOUT, status
        assert 0.25 < took < 1.0, took  # the watchdog ticks every 0.1 s; a loaded machine
        batch = client.allocate_batch(1)
        for bad in (0, -1.0, float("nan"), float("inf"), True):
            with pytest.raises(ValueError, match="deadline_s"):
                client.submit(batch, read, deadline_s=bad)
        client.free_batch(batch)
    finally:
        proxy.paused.clear()
        proxy.close()
