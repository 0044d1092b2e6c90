"""A bounded fuzz suite (hypothesis, derandomized: the same examples every run) over the gRPC
inference API (Generate, Tokenize) and the HTTP front (OpenAI completions and chat, SGLang
/generate, raw garbage), all against one embedded server with the tiny demo model.

Every answer must be a proper status: gRPC OK or a client-error code (never UNKNOWN or
INTERNAL); HTTP 2xx, or 4xx with OpenAI's error JSON (never 5xx). After each suite the server
still serves a good request and every page, pin, slot and booking is back (assert_no_leaks).
About a minute in all (44 s measured, 300 examples a test); most examples pass validation
(each request has at most two wild fields) so the stages behind it run too. It found a seed of
2**70 over HTTP failing as a 500 that leaked the request's engine pages (fixed in engine/).
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvflow.stages.api import pb2
from tests.e2e.conftest import ServerThread, assert_no_leaks

MAX_EXAMPLES = 300
FUZZ = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GRPC_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
U32 = st.integers(0, 2**32 - 1)
SMALL_U32 = st.one_of(st.integers(0, 12), U32)
FLOATS = st.one_of(
    st.floats(-3, 3, width=32), st.floats(width=32), st.sampled_from([0.0, 1e-40, 1.0, 100.0])
)
TEXT = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["", "hello", "kv cache " * 40, "\x00", "\ud7ff\U0010ffff"]),
)
BIG_PROMPT = "x" * ((1 << 20) + 1)


def _wild_names(draw: st.DrawFn, names: list[str]) -> set[str]:
    """At most two of ``names`` get a wild value; most requests get none, so most pass
    validation and the fuzz reaches the stages behind it."""
    n = min(len(names), draw(st.sampled_from([0, 0, 0, 1, 1, 2])))
    return set(draw(st.lists(st.sampled_from(names), min_size=n, max_size=n, unique=True)))


@st.composite
def fields_of(
    draw: st.DrawFn, spec: dict[str, tuple[Any, Any]], optional: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A dict with every name of ``spec`` (name -> (good, wild) strategies) but the
    ``optional`` ones left out at random; at most two values drawn from their wild side."""
    names = [n for n in spec if n not in optional or draw(st.booleans())]
    wild = _wild_names(draw, names) if names else set()
    return {n: draw(spec[n][1] if n in wild else spec[n][0]) for n in names}


# -- gRPC ---------------------------------------------------------------------------------
GOOD_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)
SAMPLING: dict[str, tuple[Any, Any]] = {
    "temperature": (st.sampled_from([0.0, 0.7, 1.0]), FLOATS),
    "top_k": (st.integers(0, 12), U32),
    "top_p": (st.sampled_from([0.0, 0.5, 1.0]), FLOATS),
    "seed": (st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "stop_token_ids": (st.lists(st.integers(0, 319), max_size=2), st.lists(U32, max_size=4)),
    "repetition_penalty": (st.sampled_from([0.0, 1.0, 1.3]), FLOATS),
    "frequency_penalty": (st.sampled_from([0.0, 0.5]), FLOATS),
    "presence_penalty": (st.sampled_from([0.0, -0.5]), FLOATS),
    "logprobs": (st.integers(0, 3), st.integers(0, 2**32 - 1)),
    "prompt_logprobs": (st.integers(0, 3), st.integers(0, 2**32 - 1)),
}
GENERATE: dict[str, tuple[Any, Any]] = {
    "tenant": (st.sampled_from(["", "a", "t-1"]), st.text(max_size=70)),
    "max_tokens": (st.integers(0, 10), st.one_of(st.integers(60, 70), U32)),
    "request_id": (st.just(""), st.text(max_size=140)),
    "skip_tokens": (st.just(0), st.integers(0, 12)),
    "stop": (st.lists(GOOD_TEXT, max_size=2), st.lists(st.text(max_size=300), max_size=18)),
    "logprob_start": (st.integers(0, 8), U32),
    "input": (
        st.one_of(
            st.tuples(st.just("prompt"), st.text(min_size=1, max_size=80)),
            st.tuples(st.just("ids"), st.lists(st.integers(0, 319), min_size=1, max_size=64)),
        ),
        st.one_of(
            st.tuples(st.just("prompt"), st.sampled_from(["", BIG_PROMPT, "\x00"])),
            st.tuples(st.just("ids"), st.lists(U32, max_size=64)),
            st.tuples(st.just("none"), st.none()),
        ),
    ),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> Any:
    fields = draw(fields_of(GENERATE))
    sampling = draw(fields_of(SAMPLING, optional=("seed", "logprobs", "prompt_logprobs")))
    which, value = fields.pop("input")
    req = pb2.GenerateRequest(sampling=pb2.SamplingParams(**sampling), **fields)
    if which == "prompt":
        req.prompt = value
    elif which == "ids":
        req.token_ids.ids.extend(value)
    return req


def _grpc_code(server: ServerThread, call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def _still_serves(server: ServerThread) -> None:
    ids, _, _ = server.generate("still serving", max_tokens=2)
    assert len(ids) >= 1
    assert_no_leaks(server)


@FUZZ
@given(req=generate_requests())
def test_fuzz_grpc_generate(server: ServerThread, req: Any) -> None:
    code = _grpc_code(server, lambda: list(server.stub.Generate(req, timeout=60)))
    event(f"status {code.name}")
    assert code in GRPC_OK, (code, req)


@FUZZ
@given(text=st.one_of(TEXT, st.just(BIG_PROMPT)))
def test_fuzz_grpc_tokenize(server: ServerThread, text: str) -> None:
    req = pb2.TokenizeRequest(text=text)
    code = _grpc_code(server, lambda: server.stub.Tokenize(req, timeout=60))
    event(f"status {code.name}")
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, code


def test_grpc_serves_after_fuzz(server: ServerThread) -> None:
    _still_serves(server)


# -- HTTP ---------------------------------------------------------------------------------
JSON_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def junk(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] | None = None) -> Any:
    """(good, wild): a wild value is any JSON at all, or ``bad`` (near misses)."""
    return good, JSON_JUNK if bad is None else st.one_of(bad, JSON_JUNK)


GOOD_TEXTS = st.text(max_size=40)
SAMPLING_FIELDS = {
    "max_tokens": junk(st.integers(1, 6), st.integers(-1, 70)),
    "temperature": junk(st.sampled_from([0.0, 0.5, 1.0]), st.floats()),
    "top_p": junk(st.sampled_from([0.5, 1.0]), st.floats()),
    "top_k": junk(st.integers(-1, 20), st.integers(-(2**40), 2**40)),
    "seed": junk(st.integers(0, 2**32), st.integers(-1, 2**70)),
    "stop": junk(
        st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, max_size=2)),
        st.lists(st.text(max_size=300), max_size=20),
    ),
    "stop_token_ids": junk(st.lists(st.integers(0, 319), max_size=2), st.lists(st.integers())),
    "frequency_penalty": junk(st.sampled_from([0.0, 0.5]), st.floats()),
    "presence_penalty": junk(st.sampled_from([0.0, 0.5]), st.floats()),
    "repetition_penalty": junk(st.sampled_from([1.0, 1.2]), st.floats()),
    "n": junk(st.just(1), st.integers(-1, 5)),
    "stream": junk(st.booleans()),
    "ignore_eos": junk(st.booleans()),
    "user": junk(GOOD_TEXTS),
}
SAMPLING_NAMES = tuple(SAMPLING_FIELDS)
PROMPTS = junk(
    st.one_of(TEXT, st.lists(st.integers(0, 319), min_size=1, max_size=20)),
    st.one_of(
        st.lists(TEXT, max_size=3), st.lists(st.integers(), max_size=20), st.just(BIG_PROMPT)
    ),
)
MODEL = junk(st.just("tiny-chat"), GOOD_TEXTS)
completion_bodies = fields_of(
    {
        "model": MODEL,
        "prompt": PROMPTS,
        **SAMPLING_FIELDS,
        "logprobs": junk(st.integers(0, 3), st.integers()),
        "echo": junk(st.booleans()),
        "best_of": junk(st.just(1), st.integers()),
    },
    optional=(*SAMPLING_NAMES, "logprobs", "echo", "best_of"),
)
message = fields_of(
    {
        "role": junk(st.sampled_from(["system", "user", "assistant"]), GOOD_TEXTS),
        "content": junk(TEXT, st.lists(st.fixed_dictionaries({"type": GOOD_TEXTS}))),
    }
)
chat_bodies = fields_of(
    {
        "model": MODEL,
        "messages": junk(st.lists(message, min_size=1, max_size=3), st.lists(message)),
        **SAMPLING_FIELDS,
        "max_completion_tokens": junk(st.integers(1, 6), st.integers()),
        "logprobs": junk(st.booleans()),
        "top_logprobs": junk(st.integers(0, 3), st.integers()),
        "stream_options": junk(st.fixed_dictionaries({"include_usage": st.booleans()})),
    },
    optional=(
        *SAMPLING_NAMES,
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "stream_options",
    ),
)
sglang_params = fields_of(
    {
        "max_new_tokens": junk(st.integers(0, 6), st.integers()),
        "temperature": junk(st.sampled_from([0.0, 1.0]), st.floats()),
        "top_p": junk(st.sampled_from([0.5, 1.0]), st.floats()),
        "top_k": junk(st.integers(-1, 20), st.integers()),
        "stop": junk(st.lists(GOOD_TEXT, max_size=2)),
        "ignore_eos": junk(st.booleans()),
        "n": junk(st.just(1), st.integers()),
        "regex": junk(st.none(), GOOD_TEXTS),
    },
    optional=("temperature", "top_p", "top_k", "stop", "ignore_eos", "n", "regex"),
)
sglang_bodies = fields_of(
    {
        "text": junk(st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3))),
        "input_ids": junk(st.lists(st.integers(0, 319), min_size=1, max_size=20)),
        "sampling_params": junk(sglang_params),
        "stream": junk(st.booleans()),
        "return_logprob": junk(st.booleans()),
        "logprob_start_len": junk(st.integers(-1, 4), st.integers()),
        "top_logprobs_num": junk(st.integers(0, 3), st.integers()),
        "rid": junk(st.just(None), GOOD_TEXTS),
    },
    optional=(
        "text",
        "input_ids",
        "stream",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "rid",
    ),
)


def _post(server: ServerThread, path: str, body: bytes) -> tuple[int, bytes, str]:
    assert server.http is not None
    conn = http.client.HTTPConnection("127.0.0.1", server.http.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("content-type") or ""
    finally:
        conn.close()


def _check_http(status: int, data: bytes, ctype: str) -> None:
    event(f"status {status}")
    assert status < 500 and status not in (301, 302, 307), (status, data[:300])
    if status >= 400:
        doc = json.loads(data)
        assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
        assert doc["error"]["code"] == status
    elif "text/event-stream" in ctype:
        assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
        for line in data.split(b"\n\n")[:-2]:
            doc = json.loads(line.removeprefix(b"data: "))
            if isinstance(doc, dict) and "error" in doc:
                assert doc["error"]["code"] < 500, doc
    else:
        json.loads(data)


def _fuzz_json(server: ServerThread, path: str, body: Any) -> None:
    data = json.dumps(body).encode()  # NaN/Infinity included: Python's JSON extension
    _check_http(*_post(server, path, data))


@FUZZ
@given(body=completion_bodies)
def test_fuzz_openai_completions(server: ServerThread, body: dict[str, Any]) -> None:
    _fuzz_json(server, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies)
def test_fuzz_openai_chat(server: ServerThread, body: dict[str, Any]) -> None:
    _fuzz_json(server, "/v1/chat/completions", body)


@FUZZ
@given(body=sglang_bodies)
def test_fuzz_sglang_generate(server: ServerThread, body: dict[str, Any]) -> None:
    _fuzz_json(server, "/generate", body)


@FUZZ
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"]),
    raw=st.one_of(st.binary(max_size=200), st.text(max_size=100).map(str.encode)),
)
def test_fuzz_http_garbage(server: ServerThread, path: str, raw: bytes) -> None:
    _check_http(*_post(server, path, raw))


def test_http_serves_after_fuzz(server: ServerThread) -> None:
    body = {"model": "tiny-chat", "prompt": "still serving", "max_tokens": 2}
    status, data, _ = _post(server, "/v1/completions", json.dumps(body).encode())
    assert status == 200, data
    assert json.loads(data)["usage"]["completion_tokens"] >= 1
    _still_serves(server)
