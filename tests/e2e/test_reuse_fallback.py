"""Reuse-load falls back to another holder when reading a block from one fails, then to
recompute: a lost cache block makes a request slower, never failed or wrong.

A real embedded server with three prefill instances (round-robin, so a prompt's three runs
land on prefill-0, -1, -2 in turn); the failure is injected into the peer the third run reads
first (prefill-0): its reads raise, as a holder that died mid-read does, or come back short, as
a checksum failure or an eviction at the holder does.
"""

from __future__ import annotations

import logging
from typing import Any

from kvflow.stages.reuse_load import ReuseLoadStage
from tests.e2e.conftest import BLOCK, assert_no_leaks
from tests.e2e.test_reuse import ids


class _DiesMidRead:
    def batch_get_into(self, keys: Any, bufs: Any) -> list[Any]:
        raise ConnectionResetError("holder died mid-read")


class _ShortReads:
    """Delegates to the holder's real client but loses every block after the first ``n``."""

    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._n = inner, n

    def batch_get_into(self, keys: Any, bufs: Any) -> list[Any]:
        got = self._inner.batch_get_into(keys[: self._n], bufs[: self._n])
        return got + [None] * (len(keys) - len(got))


class _FaultyHolder:
    """A peer whose metadata answers are true but whose reads fail."""

    def __init__(self, inner: Any, reads: Any) -> None:
        self._inner, self._reads = inner, reads

    def match_prefix(self, keys: list[bytes]) -> int:
        return int(self._inner.match_prefix(keys))

    def client(self, namespace: Any) -> Any:
        return self._reads(self._inner.client(namespace))


def _three_runs(make_server: Any, reads: Any) -> tuple[list[Any], Any]:
    server = make_server(num_prefill=3, policy="round-robin")
    cluster = server.cluster
    stage = next(s for s in cluster.pipeline.stages if isinstance(s, ReuseLoadStage))
    prompt = ids(100, seed=21)
    runs = [server.generate(prompt) for _ in range(2)]  # computed on -0, copied to -1
    assert [u.prefill_instance for _, u, _ in runs] == ["prefill-0", "prefill-1"]
    stage._peers["prefill-0"] = _FaultyHolder(cluster.prefill["prefill-0"], reads)  # type: ignore[index]
    runs.append(server.generate(prompt))
    return runs, server


def test_a_holder_that_dies_mid_read_is_replaced_by_the_next_holder(make_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvflow.stages.reuse_load")
    runs, server = _three_runs(make_server, lambda inner: _DiesMidRead())
    out, usage, _ = runs[2]
    assert usage.prefill_instance == "prefill-2"
    assert usage.cached_tokens == 6 * BLOCK  # every usable block, all read from prefill-1
    assert {t.tier: t.tokens for t in usage.cached_by_tier} == {"remote": 6 * BLOCK}
    assert out == runs[0][0]
    assert "reading from prefill-0 failed" in caplog.text
    assert_no_leaks(server)


def test_a_short_read_is_completed_from_the_next_holder(make_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvflow.stages.reuse_load")
    runs, _ = _three_runs(make_server, lambda inner: _ShortReads(inner, 2))
    out, usage, _ = runs[2]
    assert usage.cached_tokens == 6 * BLOCK  # 2 blocks from prefill-0, 4 from prefill-1
    assert out == runs[0][0]
    assert "prefill-0 holds 6 blocks past 0, only 2 could be read" in caplog.text


def test_with_every_holder_failing_the_prompt_is_recomputed(make_server):
    server = make_server(num_prefill=2, policy="round-robin")
    cluster = server.cluster
    stage = next(s for s in cluster.pipeline.stages if isinstance(s, ReuseLoadStage))
    prompt = ids(100, seed=22)
    first = server.generate(prompt)
    stage._peers["prefill-0"] = _FaultyHolder(  # type: ignore[index]
        cluster.prefill["prefill-0"], lambda inner: _DiesMidRead()
    )
    out, usage, _ = server.generate(prompt)
    assert usage.prefill_instance == "prefill-1" and usage.cached_tokens == 0
    assert out == first[0]
    assert_no_leaks(server)
