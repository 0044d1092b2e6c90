"""SGLang's native API driven by SGLang's own frontend: an ``@sgl.function`` program with
``gen`` and ``select`` run through ``RuntimeEndpoint`` against /generate, streaming and not;
plus /generate's logprobs, batches and the info, health and flush routes."""

from __future__ import annotations

import itertools
import json
import urllib.request
from typing import Any

import pytest

from tests.e2e.conftest import ServerThread
from tests.stages.api.sglang_frontend import load_frontend

sgl = load_frontend()


@pytest.fixture(scope="module")
def endpoint(server: ServerThread) -> Any:
    assert server.http is not None
    return sgl.RuntimeEndpoint(server.http.url)


@sgl.function
def qa(s: Any, question: str) -> None:
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=8, temperature=0)
    s += "\nGood answer? "
    s += sgl.select("verdict", choices=["yes", "no", "maybe"], temperature=0)


def post(server: ServerThread, path: str, body: dict[str, Any]) -> Any:
    assert server.http is not None
    req = urllib.request.Request(
        server.http.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_program_with_gen_and_select(server: ServerThread, endpoint: Any) -> None:
    assert endpoint.get_model_name() == "tiny-chat"
    state = qa.run(question="what is a kv cache?", backend=endpoint)
    answer = state["answer"]
    expected = server.generate("Q: what is a kv cache?\nA:", max_tokens=8)[2]
    assert answer == expected
    assert state["verdict"] in ("yes", "no", "maybe")
    # select scored each choice from the prompt logprobs: the pick has the best normalized one
    decision = state.get_meta_info("verdict")
    assert decision is not None and len(decision["normalized_prompt_logprobs"]) == 3
    best = max(range(3), key=lambda i: decision["normalized_prompt_logprobs"][i])
    assert ["yes", "no", "maybe"][best] == state["verdict"]


def test_program_streaming(server: ServerThread, endpoint: Any) -> None:
    state = qa.run(question="what is a block?", backend=endpoint, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"]
    assert state["answer"] == server.generate("Q: what is a block?\nA:", max_tokens=8)[2]


def test_generate_logprobs_and_batches(server: ServerThread) -> None:
    text = "hello world " * 4  # 48 tokens: three 16-token blocks
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 20,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    out = post(server, "/generate", body)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 48 and meta["completion_tokens"] == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == server.cluster.tokenizer.encode(text)[20:]
    assert all(e[0] is not None and e[0] <= 0 for e in entries)
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(t) == 2 for t in meta["output_top_logprobs"])
    # Again, with the prompt cached: only the block before position 20 is reused (position
    # 20's logprob needs position 19 computed), and the logprobs are the same.
    again = post(server, "/generate", body)["meta_info"]
    assert again["cached_tokens"] == 16
    assert [e[0] for e in again["input_token_logprobs"]] == pytest.approx(
        [e[0] for e in entries], abs=1e-5
    )
    batch = post(
        server,
        "/generate",
        {"input_ids": [[10, 11, 12], [20, 21]], "sampling_params": {"max_new_tokens": 0}},
    )
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 2]
    assert all(b["output_ids"] == [] and b["text"] == "" for b in batch)


def test_stop_strings_and_stream_are_cumulative(server: ServerThread) -> None:
    full = post(
        server,
        "/generate",
        {"text": "kv cache blocks", "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
    )
    assert len(full["text"]) > 6
    stop = full["text"][3:5]
    cut = post(
        server,
        "/generate",
        {
            "text": "kv cache blocks",
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": stop},
        },
    )
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert server.http is not None
    req = urllib.request.Request(
        server.http.url + "/generate",
        data=json.dumps(
            {
                "text": "kv cache blocks",
                "stream": True,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0},
            }
        ).encode(),
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [ln.decode() for ln in resp.read().split(b"\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(ln[len("data: ") :])["text"] for ln in lines[:-1]]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == full["text"]


def test_info_health_and_flush(server: ServerThread) -> None:
    assert server.http is not None
    url = server.http.url
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(url + "/health_generate", timeout=60) as resp:
        assert resp.status == 200
    info = json.loads(urllib.request.urlopen(url + "/get_server_info", timeout=30).read())
    assert info["served_model_name"] == "tiny-chat" and info["page_size"] == 16
    long_prompt = "block " * 20  # > one 16-token block
    post(server, "/generate", {"text": long_prompt, "sampling_params": {"max_new_tokens": 1}})
    hit = post(server, "/generate", {"text": long_prompt, "sampling_params": {"max_new_tokens": 1}})
    assert hit["meta_info"]["cached_tokens"] > 0
    req = urllib.request.Request(url + "/flush_cache", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert b"flushed" in resp.read()
    cold = post(
        server, "/generate", {"text": long_prompt, "sampling_params": {"max_new_tokens": 1}}
    )
    assert cold["meta_info"]["cached_tokens"] == 0
