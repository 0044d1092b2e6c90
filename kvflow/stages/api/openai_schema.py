"""The OpenAI request bodies kvflow reads (/v1/completions, /v1/chat/completions), and their
translation into a GenerateInput.

Every field of OpenAI's request schemas is honoured or refused with a 400 that names it
(tests/stages/api/test_openai_fields.py walks the openai package's types): ``REFUSED`` lists
what kvflow cannot do; ``ADVISORY`` the fields that by OpenAI's own definition do not change
the output (end-user ids, cache-routing hints: kvflow's prefix cache is automatic), accepted
and documented as such. Fields outside OpenAI's schema (other servers' extensions) are
ignored, as vLLM and SGLang ignore them."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, model_validator

from kvflow.stages.api.generation import GenerateInput
from kvflow.stages.api.http_errors import HttpError
from kvflow.stages.api.http_io import Body, check_text
from kvflow.stages.engine import GrammarSpec, ModelCard

REFUSED: dict[str, str] = {
    "audio": "audio output is not supported",
    "modalities": 'only the "text" modality is supported',
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "functions is deprecated: use tools",
    "function_call": "function_call is deprecated: use tool_choice",
    "reasoning_effort": "this model has no reasoning effort setting",
    "verbosity": "verbosity is not supported",
    "moderation": "moderation is not supported",
    "store": "stored completions are not supported",
    "suffix": "suffix (insertion) is not supported",
}
"""OpenAI fields kvflow refuses (400) when given a value other than null or their no-op."""

ADVISORY = (
    "user",
    "safety_identifier",
    "metadata",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "service_tier",
)
"""OpenAI fields accepted without an effect on the output (see the module docstring)."""

_NO_OP: dict[str, tuple[Any, ...]] = {
    "modalities": (["text"],),
    "store": (False,),
}


def refuse_unsupported(data: Any) -> Any:
    """A 400 naming the first REFUSED field that ``data`` (a request body) sets."""
    if isinstance(data, dict):
        for name, why in REFUSED.items():
            value = data.get(name)
            if value is not None and value not in _NO_OP.get(name, ()):
                raise HttpError(400, f"{name}: {why}", param=name)
    return data


def grammar_of_response_format(fmt: Any) -> GrammarSpec | None:
    """The grammar of OpenAI's response_format ({"type": "text" | "json_object" |
    "json_schema", "json_schema": {"name", "schema", "strict"}}); 400 naming what is wrong."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise HttpError(400, "response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise HttpError(
                400, "response_format.json_schema.schema must be a JSON schema", "response_format"
            )
        return GrammarSpec("json_schema", json.dumps(schema))
    raise HttpError(
        400,
        f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
        "response_format",
    )


def logit_bias_of(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias} as (id, bias) pairs; 400 for a key that is not an id."""
    if not bias:
        return None
    out = []
    for key, value in bias.items():
        if not key.isdigit():
            raise HttpError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


class StreamOptions(Body):
    include_usage: bool = False


class SamplingBody(Body):
    """The fields both endpoints share (vLLM's extensions included: top_k,
    repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 or 0 off, >= vocab all
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = Field(default=1, ge=1, le=16)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None

    _refuse = model_validator(mode="before")(refuse_unsupported)

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields the caller gave (None: not given)."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": None if self.top_k is None or self.top_k < 0 else self.top_k,
            "seed": self.seed,
            "stop_token_ids": None if self.stop_token_ids is None else tuple(self.stop_token_ids),
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": logit_bias_of(self.logit_bias),
            "grammar": grammar_of_response_format(self.response_format),
        }
        out = {k: v for k, v in given.items() if v is not None}
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(check_text(s, "stop") for s in stop)

    def input(
        self, card: ModelCard, tenant: str, max_tokens: int | None, **kw: Any
    ) -> GenerateInput:
        return GenerateInput(
            tenant=tenant,
            max_tokens=max_tokens,
            sampling=self.sampling(),
            defaults=card.generation.as_dict(),
            stop=self.stops(),
            include_stop=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            **kw,
        )


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=16)

    def choices(self) -> tuple[int, int]:
        """(generated, answered): best_of generations, the n best answered."""
        best_of = self.best_of or self.n
        if best_of < self.n:
            raise HttpError(400, f"best_of ({best_of}) must be >= n ({self.n})", param="best_of")
        if best_of > self.n and self.stream:
            raise HttpError(400, "best_of > n cannot stream", param="best_of")
        return best_of, self.n

    def prompt_fields(self) -> dict[str, Any]:
        """prompt_text or prompt_ids of the one prompt (a batch is a 400)."""
        p = self.prompt
        if isinstance(p, str):
            return {"prompt_text": check_text(p, "prompt")}
        if p and all(isinstance(t, int) for t in p):
            return {"prompt_ids": list(p)}  # type: ignore[arg-type]
        if len(p) == 1:
            one = p[0]
            if isinstance(one, str):
                return {"prompt_text": check_text(one, "prompt")}
            return {"prompt_ids": list(one)}  # type: ignore[arg-type]
        raise HttpError(400, "give one prompt per request", param="prompt")


class ChatBody(SamplingBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def max_new(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def messages_for_template(self) -> list[dict[str, Any]]:
        """The messages with content parts flattened to text (templates expect strings)."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        raise HttpError(400, f"messages[{i}]: only text content parts", "messages")
                    texts.append(str(part.get("text", "")))
                m = {**m, "content": "".join(texts)}
            elif content is not None and not isinstance(content, str):
                raise HttpError(400, f"messages[{i}].content must be a string or parts", "messages")
            if not isinstance(m.get("role"), str):
                raise HttpError(400, f"messages[{i}].role must be a string", "messages")
            if isinstance(m.get("content"), str):
                check_text(m["content"], f"messages[{i}].content")
            out.append(m)
        return out
