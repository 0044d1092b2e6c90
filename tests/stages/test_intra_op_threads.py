"""The intra-op thread policy: a prefill engine every core, a decode engine its share, the
environment overrides it, and the embedded server's engine threads run with it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvflow.stages.runtime import threads
from tests.e2e.conftest import ServerThread, base_config


def test_prefill_gets_every_core_decode_its_share() -> None:
    assert threads.intra_op_threads("prefill", 1, 1, 2) == 2
    assert threads.intra_op_threads("decode", 1, 1, 2) == 1
    assert threads.intra_op_threads("decode", 1, 1, 16) == 8
    assert threads.intra_op_threads("prefill", 2, 2, 16) == 8  # prefill engines share
    assert threads.intra_op_threads("decode", 2, 2, 16) == 4
    assert threads.intra_op_threads("decode", 2, 1, 2) == 1  # never zero
    with pytest.raises(ValueError, match="need engines and cores >= 1"):
        threads.intra_op_threads("decode", 0, 0, 2)
    with pytest.raises(ValueError, match="role must be one of"):
        threads.intra_op_threads("router", 1, 1, 2)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 2)
    assert threads.engine_threads("decode", 1, 1) == 1
    monkeypatch.setenv(threads.ENV_OVERRIDE, "3")
    assert threads.engine_threads("decode", 1, 1) == 3
    monkeypatch.setenv(threads.ENV_OVERRIDE, "zero")
    with pytest.raises(ValueError, match="KVFLOW_INTRA_OP_THREADS must be a positive"):
        threads.engine_threads("decode", 1, 1)
    monkeypatch.delenv(threads.ENV_OVERRIDE)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.engine_threads("prefill", 1, 1) is None  # the operator's: left alone


def _fresh_thread_count() -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join(60)
    return out[0]


@pytest.mark.slow
def test_embedded_server_engine_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvflow.stages.engine import write_demo_model

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(threads.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
        server = ServerThread(base_config(model, tmp_path / "data"))
        try:
            ids, _, _ = server.generate([5, 6, 7], max_tokens=2)
            assert len(ids) == 2
            cluster = server.cluster

            def count(worker: object) -> int:
                return worker.call(lambda _e: torch.get_num_threads()).result(60)  # type: ignore[attr-defined]

            # 4 cores: the prefill engine all 4, the decode engine its share of 2 engines.
            assert [count(i.worker) for i in cluster.prefill.values()] == [4]
            assert [count(i.worker) for i in cluster.decode.values()] == [2]
        finally:
            server.close()
        assert _fresh_thread_count() == 3  # restored: new threads start from it again
    finally:
        torch.set_num_threads(before)
