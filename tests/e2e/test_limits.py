"""Limits before work and isolation inside a batch (each fails on the code before it):
prompts capped in bytes before tokenizing (Generate and Tokenize), sampling values that are
not finite refused, a tiny temperature that no longer makes NaN, and a duplicate in-flight
request id answered ALREADY_EXISTS."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
import torch

from kvflow.stages.api import pb2
from kvflow.stages.engine import SamplingParams
from kvflow.stages.engine.sampler import sample
from tests.e2e.conftest import assert_no_leaks


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_an_oversized_prompt_is_refused_before_tokenizing(server) -> None:
    big = "kv " * (server.config.max_prompt_bytes // 3 + 10)
    started = time.monotonic()
    code, details = code_and_details(
        lambda: list(server.stub.Generate(pb2.GenerateRequest(prompt=big), timeout=30))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in details
    code, details = code_and_details(
        lambda: server.stub.Tokenize(pb2.TokenizeRequest(text=big), timeout=30)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in details
    assert time.monotonic() - started < 5.0  # refused, not tokenized
    assert list(server.stub.Tokenize(pb2.TokenizeRequest(text="kv cache"), timeout=10).token_ids)


@pytest.mark.parametrize(
    "sampling",
    [
        pb2.SamplingParams(top_p=math.nan),
        pb2.SamplingParams(top_p=-0.5),
        pb2.SamplingParams(temperature=math.inf),
        pb2.SamplingParams(temperature=math.nan),
        pb2.SamplingParams(temperature=1e9),
    ],
)
def test_sampling_values_that_are_not_sensible_are_refused(server, sampling) -> None:
    req = pb2.GenerateRequest(prompt="hi", sampling=sampling)
    code, _ = code_and_details(lambda: list(server.stub.Generate(req, timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_tiny_temperature_fails_nobody(server) -> None:
    """temperature 1e-40 passed validation and made NaN probabilities, failing every request
    of that engine step; now it is greedy, and its neighbours finish."""
    results: dict[str, object] = {}

    def run(name: str, temperature: float) -> None:
        req = pb2.GenerateRequest(
            prompt=f"kv cache {name}",
            max_tokens=6,
            sampling=pb2.SamplingParams(temperature=temperature, ignore_eos=True),
        )
        try:
            results[name] = len(
                [t for m in server.stub.Generate(req, timeout=60) for t in m.token_ids]
            )
        except grpc.RpcError as exc:
            results[name] = exc.code()

    threads = [
        threading.Thread(target=run, args=(f"r{i}", t))
        for i, t in enumerate([1e-40, 0.7, 1e-30, 1.0])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"r0": 6, "r1": 6, "r2": 6, "r3": 6}
    assert_no_leaks(server)


def test_the_sampler_never_returns_nan_rows() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [math.nan, math.nan, math.nan], [0.0, 50.0, 1.0]])
    params = [SamplingParams(temperature=0.5, seed=1)] * 3
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens = sample(logits, params, gens)
    assert all(0 <= t < 3 for t in tokens) and tokens[2] == 1


def test_a_duplicate_in_flight_request_id_is_already_exists(server) -> None:
    first = server.stub.Generate(
        pb2.GenerateRequest(
            prompt="kv cache",
            request_id="dup-1",
            max_tokens=60,
            sampling=pb2.SamplingParams(ignore_eos=True),
        ),
        timeout=60,
    )
    next(first)  # the first request is in flight
    code, details = code_and_details(
        lambda: list(
            server.stub.Generate(pb2.GenerateRequest(prompt="x", request_id="dup-1"), timeout=30)
        )
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS, details
    assert len(list(first)) >= 1  # the first one is untouched
    assert_no_leaks(server)
