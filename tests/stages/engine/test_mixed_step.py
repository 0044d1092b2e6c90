"""A step with prefill chunks and decode tokens runs them as one forward pass
(EngineConfig.mixed_forward), and produces what separate forwards produce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.stages.engine import Engine, SamplingParams
from kvflow.stages.engine.runner import ModelRunner
from tests.stages.engine.conftest import open_engine


def _run(engine: Engine) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """A decoding request, joined after two steps by two prompts that need several chunks
    each (prefill_chunk 16): most steps carry chunks and decode tokens together."""
    out: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def collect() -> None:
        for o in engine.step():
            for tok in o.new_token_ids:
                assert o.logits is not None
                out.setdefault(o.request_id, []).append((tok, o.logits[0]))

    engine.add_request("a", [5, 9, 13, 2, 7], SamplingParams(max_tokens=24))
    collect()
    collect()
    engine.add_request("b", [(7 * i) % 200 + 3 for i in range(41)], SamplingParams(max_tokens=6))
    engine.add_request("c", [(11 * i) % 150 + 3 for i in range(23)], SamplingParams(max_tokens=6))
    while engine.has_unfinished():
        collect()
    return out


def _count_forwards(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    runner: ModelRunner = engine._runner
    for name in ("prefill", "decode", "mixed"):
        original = getattr(runner, name)

        def wrapped(*args: Any, _f: Any = original, _n: str = name, **kw: Any) -> Any:
            calls.append(_n)
            return _f(*args, **kw)

        monkeypatch.setattr(runner, name, wrapped)
    return calls


def test_mixed_step_equals_separate_forwards(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = open_engine(llama_dir, prefill_chunk=16, mixed_forward=True)
    calls = _count_forwards(mixed, monkeypatch)
    got = _run(mixed)
    separate = _run(open_engine(llama_dir, prefill_chunk=16, mixed_forward=False))
    # a's prompt alone, a's decode alone, then every step with chunks carries a's token too
    assert calls[:2] == ["prefill", "decode"]
    assert "mixed" in calls[2:] and "prefill" not in calls[2:]
    assert got.keys() == separate.keys() == {"a", "b", "c"}
    for rid, tokens in separate.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in tokens], rid
        for (_, lm), (_, ls) in zip(got[rid], tokens, strict=True):
            torch.testing.assert_close(lm, ls, atol=1e-4, rtol=1e-4)


def test_a_step_with_chunks_and_decode_is_one_forward(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = open_engine(llama_dir, prefill_chunk=16)
    engine.add_request("d", [5, 9, 13], SamplingParams(max_tokens=8))
    engine.step()  # its prompt: one chunk, one forward
    engine.add_request("p", list(range(3, 40)), SamplingParams(max_tokens=2))
    calls = _count_forwards(engine, monkeypatch)
    outs = {o.request_id: o for o in engine.step()}
    assert calls == ["mixed"]
    assert len(outs["d"].new_token_ids) == 1  # the stream got its token in the same step
    assert outs["p"].num_computed_tokens == 15  # with the decode row: the budget's 16 rows


def test_prompt_logprobs_chunks_run_on_their_own(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = open_engine(llama_dir, prefill_chunk=16)
    engine.add_request("d", [5, 9, 13], SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("p", list(range(3, 40)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    calls = _count_forwards(engine, monkeypatch)
    outs = {o.request_id: o for o in engine.step()}
    assert calls == ["prefill", "decode"]
    assert len(outs["p"].prompt_logprobs) == 15  # the step's budget counts the decode row


def test_a_smaller_chunk_beside_streams_changes_no_token(llama_dir: Path) -> None:
    """mixed_chunk (the prefill budget of a step that also decodes) splits the prompts into
    more, smaller chunks while ``a`` decodes; every greedy token stays the same, and the
    prompts are computed in chunks of at most mixed_chunk tokens while ``a`` runs."""
    engine = open_engine(llama_dir, prefill_chunk=16, mixed_chunk=4)
    got = _run(engine)
    full = _run(open_engine(llama_dir, prefill_chunk=16))
    assert got.keys() == full.keys() == {"a", "b", "c"}
    for rid, tokens in full.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in tokens], rid
    engine.add_request("d", [5, 9, 13], SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("p", list(range(3, 40)), SamplingParams(max_tokens=2))
    outs = {o.request_id: o for o in engine.step()}
    assert outs["p"].num_computed_tokens == 3 and len(outs["d"].new_token_ids) == 1
