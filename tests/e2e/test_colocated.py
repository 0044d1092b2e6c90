"""The embedded server with --colocate: one engine serves the prefill and the decode stage.

The pipeline is the same (KV still goes to kvdb and is reused), so the outputs equal a plain
engine's, a repeat is served from the cache with the same tokens, and concurrent requests
decode while another prompt is prefilled in chunks, in one engine.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvflow.stages.api import pb2
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.stages.runtime.step_trace import ENV
from kvflow.tools.bench import steps
from tests.e2e.conftest import BLOCK, assert_no_leaks


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.slow
def test_colocated_server_shares_one_engine_and_matches_a_plain_engine(
    make_server, tiny_model, monkeypatch
):
    server = make_server(colocate=True, prefill_chunk=32)
    cluster = server.cluster
    prefill, decode = cluster.prefill["prefill-0"], cluster.decode["decode-0"]
    assert prefill.worker is decode.worker  # one engine, one copy of the weights
    assert prefill.worker.engine.num_pages == 2 * server.config.num_pages
    leases: list[int] = []
    lease = decode.staging.lease
    monkeypatch.setattr(decode.staging, "lease", lambda n: leases.append(n) or lease(n))

    prompts = [ids(100, seed=1), ids(150, seed=2), ids(20, seed=3), ids(70, seed=4)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # decode and chunked prefill at once
        cold = list(pool.map(lambda p: server.generate(p, max_tokens=12), prompts))
    warm_ids, warm, _ = server.generate(prompts[0], max_tokens=12)

    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=128))
    direct = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [c[0] for c in cold] == direct  # cached == recomputed == a plain engine
    assert warm.cached_tokens == (100 // BLOCK) * BLOCK
    assert warm_ids == direct[0]
    one_ids, _, _ = server.generate(prompts[3], max_tokens=1)  # no decode adopts the prefill's
    assert one_ids == direct[3][:1]
    assert leases == []  # the decode adopted the prefill's pages: nothing staged or streamed
    assert_no_leaks(server)


def test_colocate_needs_pairs(tiny_model, tmp_path):
    from tests.e2e.conftest import base_config

    with pytest.raises(ValueError, match=r"num_prefill \(2\) must equal num_decode \(1\)"):
        base_config(tiny_model, tmp_path, colocate=True, num_prefill=2, num_decode=1)


@pytest.mark.slow
def test_colocated_decode_continues_in_the_step_after_the_prefill(
    make_server, tiny_model, tmp_path, monkeypatch
):
    """The decode continues its prefill on the engine thread (decode.py): in the step trace,
    a request of max_tokens=2 finishes its one decode token in the very step after the one
    that finished its prefill, while another stream keeps the engine stepping (before, the
    decode was admitted only once the event loop had seen the first token: a step later)."""
    monkeypatch.setenv(ENV, str(tmp_path / "trace"))
    server = make_server(colocate=True, prefill_chunk=32, max_tokens_limit=256)
    stream_prompt = ids(30, seed=5)
    prompts = [ids(100, seed=1), ids(150, seed=2), ids(20, seed=3), ids(70, seed=4)]
    req = pb2.GenerateRequest(max_tokens=256, sampling=pb2.SamplingParams(ignore_eos=True))
    req.token_ids.ids.extend(stream_prompt)
    call = server.stub.Generate(req, timeout=120)
    streamed = list(next(call).token_ids)  # it decodes while the others come and go
    with ThreadPoolExecutor(len(prompts)) as pool:
        short = list(pool.map(lambda p: server.generate(p, max_tokens=2)[0], prompts))
    streamed += [t for m in call for t in m.token_ids]

    engine = Engine.open(tiny_model, EngineConfig(block_size=BLOCK, num_pages=128))
    assert short == engine.generate(prompts, SamplingParams(max_tokens=2))
    assert (
        streamed
        == engine.generate([stream_prompt], SamplingParams(max_tokens=256, ignore_eos=True))[0]
    )
    server.close()  # the trace is complete
    (path,) = tmp_path.glob("trace.*.prefill-0.jsonl")
    records = steps.load(path)
    ended = {rid: i for i, r in enumerate(records) for rid in r["finished"]}
    admitted = {rid: i for i, r in enumerate(records) for rid, _ in r["admitted"]}
    shorts = [rid[: -len("/prefill")] for rid in ended if rid.endswith("/prefill")]
    assert len(shorts) == 1 + len(prompts)
    beside_stream = 0
    for base in shorts:
        prefilled = ended[f"{base}/prefill"]
        assert admitted[f"{base}/decode"] == prefilled + 1  # before the very next step
        beside_stream += records[prefilled]["decode"] > 0
        if base != min(shorts, key=lambda b: admitted[f"{b}/prefill"]):  # not the stream
            assert ended[f"{base}/decode"] == prefilled + 1  # its one decode token, in it
    assert beside_stream >= 1  # the engine had other work: it did not wait for this one
    summary = steps.summarize(records)
    assert summary["handoffs"] == len(shorts)
    assert summary["prefill_to_decode_lag_steps_mean"] == 0


@pytest.mark.slow
def test_colocated_stop_strings_and_a_cancel_end_the_continued_decode(make_server):
    """The decode already runs when the event loop sees the first token: a stop string (in
    the first token's text or later) or a cancel ends it, and nothing is left behind."""
    server = make_server(colocate=True, prefill_chunk=32)
    sampling = pb2.SamplingParams(ignore_eos=True)
    prompt = ids(40, seed=7)
    full_ids, _, full = server.generate(prompt, max_tokens=24, sampling=sampling)
    assert len(full_ids) == 24 and len(full) > 8
    for stop in (full[:2], full[5:8]):
        _, _, text = server.generate(prompt, max_tokens=24, sampling=sampling, stop=[stop])
        assert text == full[: full.index(stop)]
    assert_no_leaks(server)

    req = pb2.GenerateRequest(max_tokens=60, sampling=sampling)
    req.token_ids.ids.extend(ids(90, seed=8))
    call = server.stub.Generate(req, timeout=60)
    assert next(call).token_ids
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert_no_leaks(server)
