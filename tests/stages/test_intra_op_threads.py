"""The intra-op thread policy: a prefill engine every core, a decode engine its share while a
prefill engine computes and every core otherwise, the environment overrides it, and the
embedded server's engine threads run with it."""

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


def test_decode_engine_adapts_to_prefill_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(threads.ENV_OVERRIDE, raising=False)
    monkeypatch.delenv(threads.ENV_DECODE, raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 2)
    plan = threads.embedded_threads(1, 1, colocate=False)
    prefill, decode = plan["prefill"], plan["decode"]
    assert prefill is not None and decode is not None
    assert decode.watches is prefill.marks is not None  # one signal, shared
    assert prefill.for_step() == 2
    assert decode.for_step() == 2  # no prefill engine inside a step: every core
    with prefill.marks.stepping():
        assert decode.for_step() == 1  # its share while the prefill computes
        assert prefill.for_step() == 2
    assert decode.for_step() == 2


def test_fixed_counts_when_asked_or_nothing_to_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(threads.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setenv(threads.ENV_DECODE, "share")
    plan = threads.embedded_threads(1, 1, colocate=False)
    assert plan == {"prefill": threads.EngineThreads(2), "decode": threads.EngineThreads(1)}
    monkeypatch.setenv(threads.ENV_DECODE, "always")
    with pytest.raises(ValueError, match="KVFLOW_DECODE_THREADS must be one of"):
        threads.embedded_threads(1, 1, colocate=False)
    monkeypatch.delenv(threads.ENV_DECODE)
    # two decode engines on 2 cores: one core each even without a prefill, nothing to adapt
    assert threads.embedded_threads(1, 2, colocate=False)["decode"] == threads.EngineThreads(1)
    # colocated: one engine per pair with every core
    assert threads.embedded_threads(1, 1, colocate=True) == {
        "prefill": threads.EngineThreads(2),
        "decode": threads.EngineThreads(2),
    }
    monkeypatch.setenv(threads.ENV_OVERRIDE, "3")
    assert threads.embedded_threads(1, 1, colocate=False)["decode"] == threads.EngineThreads(3)
    monkeypatch.delenv(threads.ENV_OVERRIDE)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.embedded_threads(1, 1, colocate=False) == {"prefill": None, "decode": None}
    with pytest.raises(ValueError, match="thread counts must be >= 1"):
        threads.EngineThreads(0)


def test_workers_mark_and_follow_prefill_steps(tmp_path: Path) -> None:
    """Real engine workers: the prefill worker is inside ``stepping`` during its steps, the
    decode worker's thread runs each step with the count the signal gives at its start."""
    from kvflow.stages.engine import Engine, EngineConfig, SamplingParams, write_demo_model
    from kvflow.stages.runtime.worker import EngineWorker, WorkItem

    model = write_demo_model(tmp_path / "tiny", "tiny", seed=0)
    steps = threads.PrefillSteps()
    prefill = EngineWorker(
        "p",
        Engine.open(model, EngineConfig()),
        intra_op_threads=threads.EngineThreads(2, marks=steps),
    )
    decode = EngineWorker(
        "d",
        Engine.open(model, EngineConfig()),
        intra_op_threads=threads.EngineThreads(1, alone=2, watches=steps),
    )
    seen_busy: list[bool] = []
    step = prefill.engine.step

    def spied_step() -> object:
        seen_busy.append(steps.busy)
        return step()

    prefill.engine.step = spied_step  # type: ignore[method-assign]
    counts: list[int] = []

    def run(worker: EngineWorker, rid: str) -> None:
        done = threading.Event()

        def sink(_engine: Engine, out: object) -> None:
            counts.append(torch.get_num_threads())  # on the engine thread, after a step
            if getattr(out, "finished", False):
                done.set()

        worker.submit(
            WorkItem(rid, [5, 6, 7], SamplingParams(max_tokens=3), sink, lambda e: done.set())
        )
        assert done.wait(60), f"{rid} did not finish"

    prefill.start()
    decode.start()
    try:
        run(prefill, "p1")
        assert seen_busy and all(seen_busy)
        assert not steps.busy  # left after each step
        counts.clear()
        run(decode, "d1")
        assert set(counts) == {2}  # no prefill inside a step: every core
        counts.clear()
        with steps.stepping():  # as if a long prefill step were running
            run(decode, "d2")
        assert set(counts) == {1}
    finally:
        prefill.stop()
        decode.stop()


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

            # 4 cores: the prefill engine all 4; the decode engine its share of 2 engines while
            # the prefill computes, else all 4 (its steps here began with the prefill done).
            assert [count(i.worker) for i in cluster.prefill.values()] == [4]
            assert [count(i.worker) for i in cluster.decode.values()] == [4]
            assert [i.worker.threads.share for i in cluster.decode.values()] == [2]
            # the process's other threads build no OpenMP team (engine/openmp.py)
            assert _fresh_thread_count() == 1
        finally:
            server.close()
        assert _fresh_thread_count() == 3  # restored: new threads start from it again
    finally:
        torch.set_num_threads(before)
