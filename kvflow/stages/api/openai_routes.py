"""The OpenAI-compatible API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(streaming as Server-Sent Events ending in ``data: [DONE]``). Chat prompts are rendered with
the model directory's chat template. Requests run through ``Generation`` (api/generation.py),
as gRPC Generate calls do."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvflow.stages.api.choices import Choices
from kvflow.stages.api.generation import GenerateInput, Generation, Usage
from kvflow.stages.api.http_errors import HttpError
from kvflow.stages.api.http_io import (
    SSE_HEADERS,
    SseTemplate,
    TokenText,
    caller_tenant,
    check_text,
    parse,
    read_json,
    sse,
    sse_stream,
    unless_disconnected,
)
from kvflow.stages.api.openai_schema import ChatBody, CompletionBody
from kvflow.stages.api.tool_calls import ToolPlan, messages_for_plain_template
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
        count, keep = body.choices()
        inp = body.input(
            self._frontend.card, caller_tenant(request), body.max_tokens, **body.prompt_fields()
        )
        want_lps = body.logprobs is not None
        if want_lps or count > keep:  # best_of ranks the choices by their logprobs
            inp = _with_logprobs(inp, body.logprobs or 0)
        if body.echo and want_lps:  # the prompt's logprobs: computed here, not read from cache
            inp = dataclasses.replace(
                inp,
                sampling={**inp.sampling, "prompt_logprobs": body.logprobs},
                logprob_start=0,
            )
        choices = await unless_disconnected(
            request, Choices.start(self._frontend, inp, count, keep)
        )  # a client that leaves while queued frees its place
        first = choices.choices[0].gen
        rid, created = f"cmpl-{first.request_id}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            slot = SseTemplate.SLOT
            text_events = [
                SseTemplate({**base, "choices": [_choice(slot, None, None, i)]})
                for i in range(count)
            ]

            async def events() -> AsyncIterator[bytes]:
                offsets = [0] * count
                if body.echo:
                    for i in range(count):
                        text, lps = self._echo(first, want_lps)
                        offsets[i] = len(text)
                        yield sse({**base, "choices": [_choice(text, lps, None, i)]})
                async for i, c in choices.merged():
                    if not want_lps:
                        yield text_events[i](c.text)
                        continue
                    lps = self._completion_logprobs(c.logprobs, offsets[i])
                    offsets[i] += len(c.text)
                    yield sse({**base, "choices": [_choice(c.text, lps, None, i)]})
                for ch in choices.choices:
                    finish = ch.gen.finish_reason
                    yield sse({**base, "choices": [_choice("", None, finish, ch.index)]})
                if include_usage:
                    yield sse({**base, "choices": [], "usage": usage_json(choices.usage())})

            return StreamingResponse(
                sse_stream(events()), media_type="text/event-stream", headers=SSE_HEADERS
            )
        answered = await unless_disconnected(request, choices.collect())
        out = []
        for ch in answered:
            text, lps = ch.text, None
            echo_text, echo_lps = self._echo(first, want_lps) if body.echo else ("", None)
            if want_lps:
                lps = self._completion_logprobs(
                    [lp for c in ch.chunks for lp in c.logprobs], len(echo_text)
                )
                if echo_lps is not None:
                    lps = {k: echo_lps[k] + lps[k] for k in lps}
            out.append(_choice(echo_text + text, lps, ch.gen.finish_reason, ch.index))
        return {**base, "choices": out, "usage": usage_json(choices.usage())}

    def _echo(self, gen: Generation, want_lps: bool) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text (echo) and, with logprobs, its tokens' entries (the first
        token has no logprob: nothing precedes it)."""
        ids = list(gen.state.prompt_ids or [])
        text = gen.state.prompt_text
        if text is None:
            text = self._frontend.tokenizer.decode(ids, skip_special_tokens=False)
        if not want_lps:
            return text, None
        start, lps = gen.prompt_logprobs
        by_pos = {start + i: lp for i, lp in enumerate(lps)}
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for pos, tok in enumerate(ids):
            tokens.append(self._text(tok))
            offsets.append(offset)
            offset += len(tokens[-1])
            lp = by_pos.get(pos)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {self._text(t): v for t, v in lp.top})
        entries = {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
        return text, entries

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
        plan = ToolPlan.of(body.tools, body.tool_choice)
        prompt = self._render(body, plan)
        inp = body.input(
            self._frontend.card,
            caller_tenant(request),
            body.max_new(),
            prompt_text=prompt,
            add_special_tokens=False,  # the template wrote them
        )
        tool_grammar = plan.grammar() if plan is not None else None
        if tool_grammar is not None:
            if "grammar" in inp.sampling:
                raise HttpError(400, "response_format cannot be combined with a forced tool call")
            inp = dataclasses.replace(inp, sampling={**inp.sampling, "grammar": tool_grammar})
        if body.logprobs:
            inp = _with_logprobs(inp, body.top_logprobs or 0)
        choices = await unless_disconnected(
            request, Choices.start(self._frontend, inp, body.n, body.n)
        )
        rid, created = f"chatcmpl-{choices.choices[0].gen.request_id}", int(time.time())
        calls_of = _calls_parser(plan, body.parallel_tool_calls)
        if body.stream:
            return self._chat_stream(body, choices, rid, created, calls_of)
        answered = await unless_disconnected(request, choices.collect())
        out = []
        for ch in answered:
            lps = None
            if body.logprobs:
                all_lps = [lp for c in ch.chunks for lp in c.logprobs]
                lps = self._chat_logprobs(all_lps, body.top_logprobs)
            content, calls = calls_of(ch.text) if calls_of is not None else (ch.text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            finish = ch.gen.finish_reason
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
            out.append(
                {"index": ch.index, "message": message, "logprobs": lps, "finish_reason": finish}
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": body.model,
                "choices": out,
                "usage": usage_json(choices.usage()),
            }
        )

    def _chat_stream(
        self,
        body: ChatBody,
        choices: Choices,
        rid: str,
        created: int,
        calls_of: Callable[[str], tuple[str | None, list[dict[str, Any]]]] | None,
    ) -> StreamingResponse:
        """Deltas as the choices produce them; with tools, each choice's text is held until
        it ends and sent as its content or its tool calls (a call is only known once whole)."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
        }
        slot = {"content": SseTemplate.SLOT}
        n = len(choices.choices)
        text_events = [
            SseTemplate({**base, "choices": [_delta(slot, None, None, i)]}) for i in range(n)
        ]

        async def events() -> AsyncIterator[bytes]:
            for i in range(n):
                role = {"role": "assistant", "content": ""}
                yield sse({**base, "choices": [_delta(role, None, None, i)]})
            async for i, c in choices.merged():
                if calls_of is not None:
                    continue  # held: sent whole below
                if not body.logprobs:
                    yield text_events[i](c.text)
                    continue
                lps = self._chat_logprobs(c.logprobs, body.top_logprobs)
                yield sse({**base, "choices": [_delta({"content": c.text}, lps, None, i)]})
            for ch in choices.choices:
                finish = ch.gen.finish_reason
                if calls_of is not None:
                    content, calls = calls_of(ch.text)
                    if calls:
                        finish = "tool_calls"
                        deltas = [{**c, "index": k} for k, c in enumerate(calls)]
                        yield sse(
                            {
                                **base,
                                "choices": [_delta({"tool_calls": deltas}, None, None, ch.index)],
                            }
                        )
                    if content:
                        yield sse(
                            {
                                **base,
                                "choices": [_delta({"content": content}, None, None, ch.index)],
                            }
                        )
                yield sse({**base, "choices": [_delta({}, None, finish, ch.index)]})
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage_json(choices.usage())})

        return StreamingResponse(
            sse_stream(events()), media_type="text/event-stream", headers=SSE_HEADERS
        )

    def _render(self, body: ChatBody, plan: ToolPlan | None) -> str:
        template = self._frontend.card.chat_template
        if template is None:
            raise HttpError(400, "this model has no chat template: use /v1/completions")
        messages = body.messages_for_template()
        tools = None
        if "tools" in template.source:  # the template renders tools and tool turns itself
            tools = plan.template_tools() if plan is not None and plan.active else None
        else:
            messages = messages_for_plain_template(messages, plan)
        try:
            text = template.render(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=tools,
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


def _choice(text: str, logprobs: Any, finish: str | None, index: int = 0) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _delta(
    delta: dict[str, Any], logprobs: Any, finish: str | None, index: int = 0
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _calls_parser(
    plan: ToolPlan | None, parallel: bool | None
) -> Callable[[str], tuple[str | None, list[dict[str, Any]]]] | None:
    """(content, tool_calls) of a finished text, when the request's tools are active;
    parallel_tool_calls=False keeps the first call only."""
    if plan is None or not plan.active:
        return None

    def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
        content, calls = plan.parse(text)
        return content, (calls[:1] if parallel is False else calls)

    return parse_calls
