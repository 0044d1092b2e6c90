"""The real default model (SmolLM2-135M-Instruct) through the OpenAI API: a repeated long
system prompt is served from the cache (usage.prompt_tokens_details.cached_tokens) and gives
the same greedy answer as a cold run (the model's output depends on its KV, unlike the tiny
demo model's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.conftest import assert_no_leaks

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a concise assistant for a storage team. The team runs a tiered key-value cache "
    "that keeps attention state in DRAM and on SSD, spread over many machines, so that a "
    "prompt that shares a prefix with an earlier one is not computed again. Answer in one "
    "short sentence, plainly, without lists, and say when you do not know."
) * 2


def ask(c: openai.OpenAI, question: str) -> Any:
    return c.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=24,
        temperature=0,
    )


def test_repeated_system_prompt_hits_the_cache(real_model: Path, make_http_server: Any) -> None:
    server = make_http_server(real_model, block_size=16, max_tokens_limit=64)
    assert server.http is not None
    c = openai.OpenAI(base_url=server.http.url + "/v1", api_key="unused", max_retries=0)
    cold = ask(c, "What is a cache?")
    assert cold.usage.prompt_tokens > 150  # the system prompt is about 140 tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = ask(c, "What is a cache?")
    assert warm.usage.prompt_tokens_details.cached_tokens >= 128
    assert warm.choices[0].message.content == cold.choices[0].message.content
    # Another question after the same system prompt: its shared blocks come from the cache,
    # and the answer is the one a cold server gives.
    other = ask(c, "Why keep data on SSD?")
    assert other.usage.prompt_tokens_details.cached_tokens >= 128
    server.call(server.cluster.flush_cache)
    other_cold = ask(c, "Why keep data on SSD?")
    assert other_cold.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == other_cold.choices[0].message.content
    assert len(cold.choices[0].message.content.split()) >= 3  # English words, not bytes
    assert_no_leaks(server)
