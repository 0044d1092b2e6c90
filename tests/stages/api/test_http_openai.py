"""The OpenAI-compatible API driven by the official `openai` client: models, completions and
chat completions, streaming and not, stop strings and stop ids, logprobs, usage, errors."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import ServerThread

PROMPT = "kv cache blocks"


def client(server: ServerThread) -> openai.OpenAI:
    assert server.http is not None
    return openai.OpenAI(base_url=server.http.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_name(server: ServerThread) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert client(server).models.retrieve("tiny-chat").id == "tiny-chat"


def test_completion_matches_grpc_and_reports_usage(server: ServerThread) -> None:
    ids, usage, grpc_text = server.generate(PROMPT, max_tokens=12)
    out = client(server).completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=12, temperature=0
    )
    assert out.choices[0].text == grpc_text
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == usage.prompt_tokens
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_non_stream(server: ServerThread) -> None:
    c = client(server)
    whole = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10)
    chunks = list(
        c.completions.create(
            model="tiny-chat",
            prompt=PROMPT,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_uses_the_template_stream_and_not(server: ServerThread) -> None:
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8)
    # The prompt is the rendered template, encoded without an extra BOS.
    rendered = "<|system|>be brief\n<|user|>hi\n<|assistant|>"
    _, usage, grpc_text = server.generate(
        list(server.cluster.tokenizer.encode(rendered)), max_tokens=8
    )
    assert whole.choices[0].message.content == grpc_text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == usage.prompt_tokens
    stream = c.chat.completions.create(
        model="tiny-chat", messages=messages, max_completion_tokens=8, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == grpc_text


def test_stop_string_cuts_the_text_and_ends_the_request(server: ServerThread) -> None:
    c = client(server)
    full = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=24).choices[0].text
    assert len(full) > 6
    stop = full[3:5]  # appears in the text: the answer ends before its first appearance
    out = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=24, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24
    kept = c.completions.create(
        model="tiny-chat",
        prompt=PROMPT,
        max_tokens=24,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids(server: ServerThread) -> None:
    c = client(server)
    first = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=4, logprobs=0)
    token = server.cluster.tokenizer.encode(first.choices[0].logprobs.tokens[0])[0]
    out = c.completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=8, extra_body={"stop_token_ids": [token]}
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == 1


def test_logprobs_completions_and_chat(server: ServerThread) -> None:
    c = client(server)
    out = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=5, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        max(top.values()) == pytest.approx(v)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chat = c.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def test_seeded_sampling_and_penalties(server: ServerThread) -> None:
    c = client(server)
    kw = {"model": "tiny-chat", "prompt": PROMPT, "max_tokens": 12}
    a = c.completions.create(temperature=1.0, seed=7, top_p=0.9, **kw).choices[0].text
    b = c.completions.create(temperature=1.0, seed=7, top_p=0.9, **kw).choices[0].text
    assert a == b
    greedy = c.completions.create(**kw).choices[0].text
    penalized = c.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw)
    assert penalized.choices[0].text != greedy  # the tiny model repeats; penalties break it


def test_errors_in_openai_shape(server: ServerThread) -> None:
    c = client(server)
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="nope", prompt=PROMPT)
    assert err.value.body["code"] == 404
    with pytest.raises(openai.BadRequestError, match="stop"):
        c.completions.create(model="tiny-chat", prompt=PROMPT, stop=[f"s{i}" for i in range(17)])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model="tiny-chat", prompt=PROMPT, temperature=-1)
    # still serving
    assert c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2).usage
