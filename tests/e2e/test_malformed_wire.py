"""Bytes that do not parse as the request message (invalid UTF-8 in a string field, garbage,
a truncated field) are INVALID_ARGUMENT with no traceback in the log, on every RPC shape;
the server keeps serving and leaks nothing. Before: gRPC's deserializer failed first (a
logged traceback, UNKNOWN/INTERNAL)."""

from __future__ import annotations

import logging

import grpc
import pytest

from tests.e2e.conftest import assert_no_leaks
from tests.e2e.test_reuse import ids

BAD_UTF8_PROMPT = b"\x0a\x03\xff\xfe\xfd"  # field 1 (prompt), 3 bytes that are not UTF-8
BAD = {
    "invalid utf-8": BAD_UTF8_PROMPT,
    "garbage": b"\xff\xff\xff\xff",
    "truncated": b"\x0a\x40abc",  # says 64 bytes follow, 3 do
}


@pytest.mark.parametrize("payload", list(BAD.values()), ids=list(BAD))
@pytest.mark.parametrize(
    ("method", "streaming"),
    [("/kvflow.v1.Inference/Generate", True), ("/kvflow.v1.Inference/Tokenize", False)],
)
def test_malformed_bytes_are_invalid_argument_without_a_traceback(
    server, caplog, method, streaming, payload
):
    channel = server.channel
    caplog.set_level(logging.DEBUG)
    if streaming:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            list(call(payload, timeout=30))
    else:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            call(payload, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "malformed request" in err.value.details()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    out, _, _ = server.generate(ids(30, seed=40))
    assert out
    assert_no_leaks(server)
