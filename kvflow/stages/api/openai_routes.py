"""The OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streaming as Server-Sent Events ending in ``data: [DONE]``). Chat prompts are rendered with
the model directory's chat template. Requests run through ``Generation`` (api/generation.py),
as gRPC Generate calls do."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.stages.api.generation import GenerateInput, Generation, Usage
from kvflow.stages.api.http_errors import HttpError
from kvflow.stages.api.http_io import (
    SSE_HEADERS,
    SseTemplate,
    TokenText,
    caller_tenant,
    check_text,
    collect,
    parse,
    primed,
    read_json,
    sse,
    sse_stream,
    unless_disconnected,
)
from kvflow.stages.api.openai_schema import ChatBody, CompletionBody
from kvflow.stages.engine import TokenLogprob
from kvflow.stages.engine.chat_template import ChatTemplateError


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class OpenAIApi:
    """The routes over one Frontend (api/inference.py); ``max_body_bytes`` caps a body."""

    def __init__(self, frontend: Any, max_body_bytes: int) -> None:
        self._frontend = frontend
        self._limit = max_body_bytes
        self._text = TokenText(frontend.tokenizer)
        self._created = int(time.time())

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/v1/models", self.models, methods=["GET"])
        r.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        return r

    # -- models -----------------------------------------------------------------------------
    def _model_json(self) -> dict[str, Any]:
        f = self._frontend
        return {
            "id": f.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "kvflow",
            "max_model_len": f.max_model_len,
        }

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_json()]}

    async def model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return self._model_json()

    def _check_model(self, model: str) -> None:
        if model != self._frontend.model_name:
            raise HttpError(404, f"The model `{model}` does not exist.", param="model")

    # -- completions ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Any:
        body = parse(CompletionBody, await read_json(request, self._limit))
        self._check_model(body.model)
        inp = body.input(
            self._frontend.card, caller_tenant(request), body.max_tokens, **body.prompt_fields()
        )
        if body.logprobs is not None:
            inp = _with_logprobs(inp, body.logprobs)
        gen = Generation(self._frontend, inp)
        rid, created = f"cmpl-{gen.request_id}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        want_lps = body.logprobs is not None
        if body.stream:
            chunks = await primed(gen.chunks())
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            text_event = SseTemplate({**base, "choices": [_choice(SseTemplate.SLOT, None, None)]})

            async def events() -> AsyncIterator[bytes]:
                offset = 0
                async for c in chunks:
                    if not want_lps:
                        yield text_event(c.text)
                        continue
                    lps = self._completion_logprobs(c.logprobs, offset)
                    offset += len(c.text)
                    yield sse({**base, "choices": [_choice(c.text, lps, None)]})
                yield sse({**base, "choices": [_choice("", None, gen.finish_reason)]})
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage_json(gen.usage())})

            return StreamingResponse(
                sse_stream(events()), media_type="text/event-stream", headers=SSE_HEADERS
            )
        parts = await unless_disconnected(request, collect(gen.chunks()))
        text = "".join(c.text for c in parts)
        lps = (
            self._completion_logprobs([lp for c in parts for lp in c.logprobs], 0)
            if want_lps
            else None
        )
        return {
            **base,
            "choices": [_choice(text, lps, gen.finish_reason)],
            "usage": usage_json(gen.usage()),
        }

    def _completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in lps:
            tokens.append(self._text(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    # -- chat -------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Any:
        body = parse(ChatBody, await read_json(request, self._limit))
        self._check_model(body.model)
        prompt = self._render(body)
        inp = body.input(
            self._frontend.card,
            caller_tenant(request),
            body.max_new(),
            prompt_text=prompt,
            add_special_tokens=False,  # the template wrote them
        )
        if body.logprobs:
            inp = _with_logprobs(inp, body.top_logprobs or 0)
        gen = Generation(self._frontend, inp)
        rid, created = f"chatcmpl-{gen.request_id}", int(time.time())
        if body.stream:
            chunks = await primed(gen.chunks())
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            base = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
            }

            slot = {"content": SseTemplate.SLOT}
            text_event = SseTemplate({**base, "choices": [_delta(slot, None, None)]})

            async def events() -> AsyncIterator[bytes]:
                role = {"role": "assistant", "content": ""}
                yield sse({**base, "choices": [_delta(role, None, None)]})
                async for c in chunks:
                    if not body.logprobs:
                        yield text_event(c.text)
                        continue
                    lps = self._chat_logprobs(c.logprobs, body.top_logprobs)
                    yield sse({**base, "choices": [_delta({"content": c.text}, lps, None)]})
                yield sse({**base, "choices": [_delta({}, None, gen.finish_reason)]})
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage_json(gen.usage())})

            return StreamingResponse(
                sse_stream(events()), media_type="text/event-stream", headers=SSE_HEADERS
            )
        parts = await unless_disconnected(request, collect(gen.chunks()))
        lps = None
        if body.logprobs:
            lps = self._chat_logprobs([lp for c in parts for lp in c.logprobs], body.top_logprobs)
        message = {"role": "assistant", "content": "".join(c.text for c in parts)}
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": lps,
                        "finish_reason": gen.finish_reason,
                    }
                ],
                "usage": usage_json(gen.usage()),
            }
        )

    def _render(self, body: ChatBody) -> str:
        template = self._frontend.card.chat_template
        if template is None:
            raise HttpError(400, "this model has no chat template: use /v1/completions")
        try:
            text = template.render(
                body.messages_for_template(),
                add_generation_prompt=body.add_generation_prompt,
                tools=body.tools,
                **(body.chat_template_kwargs or {}),
            )
        except ChatTemplateError as exc:
            raise HttpError(400, f"chat template: {exc}", param="messages") from None
        except TypeError as exc:
            raise HttpError(400, f"chat_template_kwargs: {exc}") from None
        return check_text(text, "the rendered chat")

    def _chat_logprobs(self, lps: list[TokenLogprob], top: int | None) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t, v) for t, v in lp.top[: top or 0]],
                }
                for lp in lps
            ]
        }


def _with_logprobs(inp: GenerateInput, n: int) -> GenerateInput:
    return dataclasses.replace(inp, sampling={**inp.sampling, "logprobs": n})


def _choice(text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _delta(delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
