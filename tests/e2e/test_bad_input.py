"""Bad input gets a clear status code; the server keeps serving and leaks nothing."""

from __future__ import annotations

import grpc
import pytest

from kvflow.stages.api import pb2
from tests.e2e.conftest import assert_no_leaks
from tests.e2e.test_reuse import ids


def _call(server, **fields) -> grpc.RpcError:
    req = pb2.GenerateRequest(**fields)
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(req, timeout=30))
    return err.value


def _ids(values: list[int]) -> pb2.TokenIds:
    return pb2.TokenIds(ids=values)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"token_ids": _ids([])}, "prompt is empty"),
        ({}, "give a prompt"),
        ({"token_ids": _ids([5] * 4100)}, "exceeds the model's maximum"),
        ({"token_ids": _ids([5, 999999])}, "outside the vocabulary"),
        ({"prompt": "hi", "max_tokens": 100000}, "max_tokens 100000 is out of range"),
        ({"prompt": "hi", "sampling": pb2.SamplingParams(temperature=-1)}, "temperature"),
        ({"prompt": "hi", "sampling": pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"prompt": "hi", "tenant": "bad tenant!"}, "tenant must be"),
        ({"prompt": "hi", "tenant": "x" * 65}, "tenant must be"),
        ({"prompt": "hi", "request_id": "a/b"}, "request_id"),
    ],
)
def test_invalid_argument(server, fields, needle):
    err = _call(server, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert needle in err.details()


def test_server_still_serves_after_bad_input_and_leaks_nothing(server):
    bad = ({"prompt": ""}, {"token_ids": _ids([5, 999999])}, {"prompt": "hi", "tenant": "?"})
    for fields in bad:
        _call(server, **fields)
    out, usage, _ = server.generate(ids(50, seed=20))
    assert len(out) == 8 and usage.prompt_tokens == 50
    assert_no_leaks(server)


def test_client_disconnect_mid_stream_frees_pages_and_pins(server):
    prompt = ids(120, seed=21)
    server.generate(prompt)  # warm: the second request pins cached blocks
    req = pb2.GenerateRequest(max_tokens=60, sampling=pb2.SamplingParams(ignore_eos=True))
    req.token_ids.ids.extend(prompt)
    call = server.stub.Generate(req, timeout=30)
    first = next(call)
    assert first.token_ids
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert_no_leaks(server)
    _, usage, _ = server.generate(prompt)
    assert usage.cached_tokens == 112


def test_deadline_from_the_client(server):
    req = pb2.GenerateRequest(max_tokens=64, sampling=pb2.SamplingParams(ignore_eos=True))
    req.token_ids.ids.extend(ids(300, seed=22))
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.Generate(req, timeout=0.001))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_leaks(server)
