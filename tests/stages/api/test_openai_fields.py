"""Every field of OpenAI's chat and completion request schemas (read from the installed
openai package's types) is honoured or refused with a 400 that names it: none is accepted
and silently dropped. A field the package adds later fails the coverage test until it is
classified here (and in openai_schema.py)."""

from __future__ import annotations

from typing import Any

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
import requests

from kvflow.stages.api.openai_schema import ADVISORY, REFUSED
from tests.e2e.conftest import ServerThread

CHAT_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"prompt": "hi", "max_tokens": 2}

# Fields kvflow honours, each with a test elsewhere that sees its effect.
HONOURED_CHAT = {
    "frequency_penalty": "test_http_openai / engine penalties",
    "logit_bias": "test_structured_output::test_logit_bias_bans_and_forces_a_token",
    "logprobs": "test_http_openai (chat logprobs)",
    "top_logprobs": "test_http_openai (chat logprobs)",
    "max_completion_tokens": "test_http_openai",
    "max_tokens": "test_http_openai",
    "messages": "every chat test",
    "model": "test_http_openai (unknown model is a 404)",
    "n": "test_structured_output::test_n_in_chat_streams_every_index",
    "parallel_tool_calls": "tool_calls parser (False keeps the first call)",
    "presence_penalty": "engine penalties",
    "response_format": "test_structured_output::test_json_schema_output_validates...",
    "seed": "test_http_openai (same seed, same text)",
    "stop": "test_http_openai (stop strings)",
    "stream_options": "test_http_openai (include_usage)",
    "temperature": "test_http_openai",
    "tool_choice": "test_structured_output (named, required, none)",
    "tools": "test_structured_output::test_named_tool_call_round_trips...",
    "top_p": "engine sampler",
}
HONOURED_COMPLETION = {
    "best_of": "test_structured_output::test_best_of_returns_the_most_likely",
    "echo": "test_structured_output::test_echo_with_prompt_logprobs",
    "frequency_penalty": "engine penalties",
    "logit_bias": "test_structured_output::test_logit_bias_bans_and_forces_a_token",
    "logprobs": "test_http_openai (completion logprobs)",
    "max_tokens": "test_http_openai",
    "model": "test_http_openai",
    "n": "test_structured_output::test_n_returns_choices_sharing_the_prompt",
    "presence_penalty": "engine penalties",
    "prompt": "every completion test",
    "seed": "test_http_openai",
    "stop": "test_http_openai",
    "stream_options": "test_http_openai",
    "temperature": "test_http_openai",
    "top_p": "engine sampler",
}

# A value of each refused field that must be a 400.
REFUSED_VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "reasoning_effort": "low",
    "verbosity": "low",
    "moderation": {"categories": ["hate"]},
    "store": True,
    "suffix": " the end",
}
# A value of each advisory field that must be accepted (200).
ADVISORY_VALUES: dict[str, Any] = {
    "user": "user-1",
    "safety_identifier": "id-1",
    "metadata": {"k": "v"},
    "prompt_cache_key": "k",
    "prompt_cache_retention": "in-memory",
    "prompt_cache_options": {},
    "service_tier": "auto",
}


def fields(module: Any) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__)


def test_every_openai_field_is_classified() -> None:
    chat, completion = fields(chat_params), fields(completion_params)
    classified_chat = set(HONOURED_CHAT) | set(REFUSED) | set(ADVISORY)
    classified_completion = set(HONOURED_COMPLETION) | set(REFUSED) | set(ADVISORY)
    assert chat - classified_chat == set()
    assert completion - classified_completion == set()
    assert set(REFUSED_VALUES) == set(REFUSED)
    assert set(ADVISORY_VALUES) == set(ADVISORY)


def post(server: ServerThread, path: str, body: dict[str, Any]) -> requests.Response:
    assert server.http is not None
    return requests.post(server.http.url + path, json=body, timeout=60)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_fields_are_a_400_naming_them(server: ServerThread, field: str) -> None:
    model = server.cluster.model_name
    for path, base, names in (
        ("/v1/chat/completions", CHAT_BASE, fields(chat_params)),
        ("/v1/completions", COMPLETION_BASE, fields(completion_params)),
    ):
        if field not in names:
            continue
        r = post(server, path, {**base, "model": model, field: REFUSED_VALUES[field]})
        assert r.status_code == 400, (path, field, r.text)
        assert field in r.json()["error"]["message"]


def test_advisory_fields_are_accepted(server: ServerThread) -> None:
    model = server.cluster.model_name
    for path, base, names in (
        ("/v1/chat/completions", CHAT_BASE, fields(chat_params)),
        ("/v1/completions", COMPLETION_BASE, fields(completion_params)),
    ):
        given = {k: v for k, v in ADVISORY_VALUES.items() if k in names}
        r = post(server, path, {**base, "model": model, **given})
        assert r.status_code == 200, (path, r.text)


def test_refused_fields_at_their_no_op_are_accepted(server: ServerThread) -> None:
    model = server.cluster.model_name
    body = {**CHAT_BASE, "model": model, "store": False, "modalities": ["text"]}
    assert post(server, "/v1/chat/completions", body).status_code == 200
