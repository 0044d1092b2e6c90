"""The intra-op thread policy: each busy engine an equal share of the cores, the environment
overrides it, and the embedded server applies it while it runs and restores it at close."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvflow.stages.runtime import threads
from tests.e2e.conftest import ServerThread, base_config


def test_each_engine_gets_an_equal_share_of_the_cores() -> None:
    assert threads.intra_op_threads(2, 2) == 1
    assert threads.intra_op_threads(1, 2) == 2
    assert threads.intra_op_threads(2, 16) == 8
    assert threads.intra_op_threads(3, 2) == 1  # never zero
    with pytest.raises(ValueError, match="engines and cores must be >= 1"):
        threads.intra_op_threads(0, 2)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv(threads.ENV_OVERRIDE, "3")
        assert threads.apply_intra_op_threads(2) == before
        assert torch.get_num_threads() == 3
        monkeypatch.setenv(threads.ENV_OVERRIDE, "zero")
        with pytest.raises(ValueError, match="KVFLOW_INTRA_OP_THREADS must be a positive"):
            threads.apply_intra_op_threads(2)
        monkeypatch.delenv(threads.ENV_OVERRIDE)
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        torch.set_num_threads(4)
        assert threads.apply_intra_op_threads(2) == 4
        assert torch.get_num_threads() == 4  # the operator's OMP_NUM_THREADS: left alone
    finally:
        torch.set_num_threads(before)


def _fresh_thread_count() -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    t.start()
    t.join(60)
    return out[0]


@pytest.mark.slow
def test_embedded_server_applies_and_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
            workers = [i.worker for i in server.cluster.prefill.values()]
            workers += [i.worker for i in server.cluster.decode.values()]
            counts = [w.call(lambda _e: torch.get_num_threads()).result(60) for w in workers]
            assert counts == [2, 2]  # 4 cores, a prefill and a decode engine: 2 each
        finally:
            server.close()
        assert _fresh_thread_count() == 3  # restored: new threads start from it again
    finally:
        torch.set_num_threads(before)
