"""The OpenAI request bodies kvflow reads (/v1/completions, /v1/chat/completions), and their
translation into a GenerateInput. Fields kvflow has no use for are ignored; fields it cannot
honour (n > 1, echo, best_of) are a 400."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvflow.stages.api.generation import GenerateInput
from kvflow.stages.api.http_errors import HttpError
from kvflow.stages.api.http_io import Body, check_text
from kvflow.stages.engine import ModelCard


class StreamOptions(Body):
    include_usage: bool = False


class SamplingBody(Body):
    """The fields both endpoints share (vLLM's extensions included: top_k,
    repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None

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
        }
        out = {k: v for k, v in given.items() if v is not None}
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out

    def stops(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(check_text(s, "stop") for s in stop)

    def check(self) -> None:
        if self.n != 1:
            raise HttpError(400, "n must be 1 (one choice per request)", param="n")

    def input(
        self, card: ModelCard, tenant: str, max_tokens: int | None, **kw: Any
    ) -> GenerateInput:
        self.check()
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
    best_of: int | None = None

    def prompt_fields(self) -> dict[str, Any]:
        """prompt_text or prompt_ids of the one prompt (a batch is a 400)."""
        if self.echo or (self.best_of or 1) != 1:
            raise HttpError(400, "echo and best_of are not supported")
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
