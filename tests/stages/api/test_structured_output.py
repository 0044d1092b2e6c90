"""Structured output, tools, n, best_of, echo and logit_bias through the real openai client
against the real default model (SmolLM2-135M-Instruct) on an embedded server: the outputs are
checked by what they must be (a JSON schema validated with jsonschema, a regex matched, a
tool call parsed into the client's types), not by fixed texts."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.e2e.conftest import ServerThread, assert_no_leaks

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from tests.stages.api.conftest import http_server

    s = http_server(real_model, tmp_path_factory.mktemp("data"), block_size=16)
    yield s
    s.close()


def client(server: ServerThread) -> openai.OpenAI:
    assert server.http is not None
    return openai.OpenAI(base_url=server.http.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_output_validates_in_20_of_20_seeded_runs(server: ServerThread) -> None:
    assert server.http is not None
    c = openai.AsyncOpenAI(base_url=server.http.url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    async def one(seed: int) -> Any:
        return await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt,  # type: ignore[arg-type]
            temperature=0.9,
            seed=seed,
            max_tokens=64,
        )

    async def all_runs() -> list[Any]:
        try:
            return await asyncio.gather(*(one(seed) for seed in range(20)))
        finally:
            await c.close()

    outs = asyncio.run(all_runs())
    texts = set()
    for out in outs:
        assert out.choices[0].finish_reason == "stop"
        value = json.loads(out.choices[0].message.content)
        jsonschema.validate(value, PERSON)
        texts.add(out.choices[0].message.content)
    assert len(texts) > 1  # seeded sampling, not one forced text
    assert_no_leaks(server)


def test_json_object_gives_an_object(server: ServerThread) -> None:
    out = client(server).completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat:",
        max_tokens=48,
        temperature=0.7,
        seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert choice.text.lstrip().startswith("{")


def test_a_bad_schema_is_a_400_naming_it(server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={  # type: ignore[typeddict-item]
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        )


def test_named_tool_call_round_trips_through_the_client_types(server: ServerThread) -> None:
    c = client(server)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert isinstance(call, openai.types.chat.ChatCompletionMessageFunctionToolCall)
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # The call and its result go back in the history; the model answers in text.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'},
    ]
    final = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert final.choices[0].message.content
    assert not final.choices[0].message.tool_calls


def test_required_tool_call_streams_as_tool_call_deltas(server: ServerThread) -> None:
    stream = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    names, args, finish = [], "", None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.function and d.function.name:
                    names.append(d.function.name)
                args += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"]
    assert "city" in json.loads(args)
    assert finish == "tool_calls"


def test_tool_choice_none_answers_in_text(server: ServerThread) -> None:
    out = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content


def test_n_returns_choices_sharing_the_prompt(server: ServerThread) -> None:
    c = client(server)
    prompt = "Once upon a time in a quiet village by the sea, there lived " * 4
    out = c.completions.create(
        model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11
    )
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert len({ch.text for ch in out.choices}) > 1  # each choice its own seed stream
    assert 3 <= out.usage.completion_tokens <= 3 * 8  # every choice's tokens
    one = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert out.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    again = c.completions.create(
        model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11
    )
    assert [ch.text for ch in again.choices] == [ch.text for ch in out.choices]


def test_n_in_chat_streams_every_index(server: ServerThread) -> None:
    stream = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        stream=True,
    )
    finished = {ch.index for chunk in stream for ch in chunk.choices if ch.finish_reason}
    assert finished == {0, 1}


def test_best_of_returns_the_most_likely(server: ServerThread) -> None:
    out = client(server).completions.create(
        model=MODEL,
        prompt="The capital of France is",
        n=1,
        best_of=3,
        max_tokens=4,
        temperature=1.0,
        seed=2,
        logprobs=0,
    )
    assert len(out.choices) == 1
    assert out.choices[0].logprobs is not None
    assert out.usage.completion_tokens >= 3  # three generated, one answered


def test_echo_with_prompt_logprobs(server: ServerThread) -> None:
    prompt = "The capital of France is"
    out = client(server).completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0
    )
    choice = out.choices[0]
    assert choice.text.startswith(prompt)
    lps = choice.logprobs
    assert lps is not None and lps.token_logprobs is not None
    n_prompt = out.usage.prompt_tokens
    assert len(lps.token_logprobs) == n_prompt + out.usage.completion_tokens
    assert lps.token_logprobs[0] is None  # nothing precedes the first token
    assert all(v is not None and v <= 0 for v in lps.token_logprobs[1:])


def test_logit_bias_bans_and_forces_a_token(server: ServerThread) -> None:
    c = client(server)
    prompt = "The capital of France is"
    plain = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1
    )
    top = plain.choices[0].logprobs.tokens[0]  # type: ignore[union-attr]
    tok = server.cluster.tokenizer.encode(top)
    assert len(tok) == 1
    banned = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(tok[0]): -100}
    )
    assert banned.choices[0].text != top
    forced = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logit_bias={"1000": 100}
    )
    forced_text = server.cluster.tokenizer.decode([1000] * 3)
    assert forced.choices[0].text == forced_text


def test_sglang_generate_regex_ebnf_and_json_schema(server: ServerThread) -> None:
    assert server.http is not None
    url = server.http.url + "/generate"
    cases = [
        ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        ({"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        (
            {"json_schema": json.dumps(PERSON)},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
    ]
    for extra, ok in cases:
        body = {
            "text": "Answer:",
            "sampling_params": {"max_new_tokens": 64, "temperature": 0.5, **extra},
        }
        r = requests.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert ok(r.json()["text"]), (extra, r.json()["text"])
    two = {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}
    r = requests.post(url, json=two, timeout=60)
    assert r.status_code == 400 and "one of regex" in r.text


def test_sglang_frontend_gen_regex(server: ServerThread) -> None:
    from tests.stages.api.sglang_frontend import load_frontend

    sgl = load_frontend()
    assert server.http is not None
    backend = sgl.RuntimeEndpoint(server.http.url)

    @sgl.function
    def phone(s: Any) -> None:
        s += "A phone number: " + sgl.gen("number", max_tokens=16, regex=r"[0-9]{3}-[0-9]{4}")

    state = phone.run(backend=backend, temperature=0.7)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["number"]), state["number"]


@pytest.mark.parametrize("block_id", ["structured-json-schema", "structured-tools"])
def test_the_docs_python_blocks_run(server: ServerThread, block_id: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.docs.blocks import block

    assert server.http is not None
    code = block("structured-output.md", block_id).replace("http://127.0.0.1:8000", server.http.url)
    assert server.http.url in code
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_the_docs_regex_curl_runs(server: ServerThread) -> None:
    import subprocess

    from tests.docs.blocks import block

    assert server.http is not None
    cmd = block("structured-output.md", "structured-regex").replace(
        "127.0.0.1:8000", server.http.url.removeprefix("http://")
    )
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", json.loads(out.stdout)["text"])
