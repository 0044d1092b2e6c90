"""SGLang's native API: POST /generate (one prompt or a batch; text or input_ids; an SSE stream
of cumulative text), GET /get_model_info, GET /get_server_info, POST /flush_cache,
GET /health, GET /health_generate. What SGLang's frontend (``sglang.RuntimeEndpoint``) calls.

Logprobs come as SGLang gives them: ``[logprob, token_id, text | None]`` per token; input
logprobs from ``logprob_start_len`` on (-1: none); position 0 has logprob None. The KV of
the positions before ``logprob_start_len`` may come from the cache; from it on it is computed.
``max_new_tokens: 0`` (the frontend's way to score or cache a prompt) runs the prefill and
returns no tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import Field

from kvflow.stages.api.choices import check_grammar
from kvflow.stages.api.generation import GenerateInput, Generation
from kvflow.stages.api.http_errors import HttpError, http_error_for
from kvflow.stages.api.http_io import (
    SSE_HEADERS,
    Body,
    TokenText,
    caller_tenant,
    check_text,
    parse,
    primed,
    read_json,
    sse,
    sse_stream,
    unless_disconnected,
)
from kvflow.stages.engine import GrammarSpec, TokenLogprob

# sampling_params keys kvflow cannot honour: accepted only when empty (the frontend sends
# them all, mostly empty).
_UNSUPPORTED = ("stop_regex", "structural_tag")
# The constrained-decoding keys (SGLang's): at most one per request, text each.
_GRAMMARS = ("regex", "json_schema", "ebnf")


def _grammar_of(sp: SamplingParamsBody) -> GrammarSpec | None:
    """The grammar SGLang's sampling_params ask for (regex, json_schema or ebnf); 400 for two
    at once or a value that is not text (json_schema may also be an object)."""
    given = [(k, getattr(sp, k)) for k in _GRAMMARS if getattr(sp, k) not in (None, "")]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(k for k, _ in given)
        raise HttpError(400, f"sampling_params: give one of regex, json_schema, ebnf (got {names})")
    kind, value = given[0]
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise HttpError(400, f"sampling_params.{kind} must be a string", param=kind)
    try:
        return GrammarSpec(kind, value)
    except ValueError as exc:
        raise HttpError(400, f"sampling_params.{kind}: {exc}", param=kind) from None


class SamplingParamsBody(Body):
    max_new_tokens: int = Field(default=128, ge=0)
    min_new_tokens: int = 0
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = 0.0
    seed: int | None = Field(default=None, alias="sampling_seed")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    stop_regex: Any = None
    structural_tag: Any = None


class GenerateBody(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    rid: str | None = None


class SGLangApi:
    """The routes over one Frontend; ``max_body_bytes`` caps a body, ``max_batch`` the
    prompts of one /generate."""

    def __init__(self, frontend: Any, max_body_bytes: int, max_batch: int) -> None:
        self._frontend = frontend
        self._limit = max_body_bytes
        self._max_batch = max_batch
        self._text = TokenText(frontend.tokenizer)

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/generate", self.generate, methods=["POST", "PUT"])
        r.add_api_route("/get_model_info", self.model_info, methods=["GET"])
        r.add_api_route("/model_info", self.model_info, methods=["GET"])
        r.add_api_route("/get_server_info", self.server_info, methods=["GET"])
        r.add_api_route("/server_info", self.server_info, methods=["GET"])
        r.add_api_route("/flush_cache", self.flush_cache, methods=["GET", "POST"])
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/health_generate", self.health_generate, methods=["GET"])
        return r

    # -- info -------------------------------------------------------------------------------
    async def model_info(self) -> dict[str, Any]:
        f = self._frontend
        return {
            "model_path": f.model_name,
            "tokenizer_path": f.model_name,
            "served_model_name": f.model_name,
            "is_generation": True,
            "max_model_len": f.max_model_len,
            "preferred_sampling_params": None,
        }

    async def server_info(self) -> dict[str, Any]:
        f = self._frontend
        from kvflow import __version__

        return {
            "version": f"kvflow {__version__}",
            "model_path": f.model_name,
            "served_model_name": f.model_name,
            "model_fingerprint": f.model_fingerprint,
            "context_length": f.max_model_len,
            "page_size": f.block_size,
            "max_tokens_limit": f.config.max_tokens_limit,
            "policy": f.conductor.policy_name,
            "prefill_instances": sorted(f.prefill),
            "decode_instances": sorted(f.decode),
        }

    async def flush_cache(self) -> Response:
        try:
            removed = await self._frontend.flush_cache()
        except Exception as exc:
            return PlainTextResponse(str(http_error_for(exc).message), status_code=400)
        return PlainTextResponse(f"Cache flushed: {removed} blocks removed.\n")

    async def health(self) -> Response:
        ok = bool(self._frontend.pipeline.running)
        return Response(status_code=200 if ok else 503)

    async def health_generate(self, request: Request) -> Response:
        """200 once one token was generated end to end (prompt: the BOS or token 0)."""
        card = self._frontend.card
        first = card.bos_token_id if card.bos_token_id is not None else 0
        inp = GenerateInput(prompt_ids=[first], tenant=caller_tenant(request), max_tokens=1)
        try:
            gen = Generation(self._frontend, inp)
            async for _ in gen.chunks():
                pass
        except Exception as exc:
            return PlainTextResponse(str(exc), status_code=503)
        return Response(status_code=200)

    # -- generate ---------------------------------------------------------------------------
    async def generate(self, request: Request) -> Any:
        body = parse(GenerateBody, await read_json(request, self._limit))
        prompts, batched = self._prompts(body)
        params = body.sampling_params
        if isinstance(params, list) and len(params) != len(prompts):
            raise HttpError(400, "sampling_params: one per prompt", param="sampling_params")
        each = params if isinstance(params, list) else [params or {}] * len(prompts)
        tenant = caller_tenant(request)
        params_list = [parse(SamplingParamsBody, s) for s in each]
        rid = "" if batched else body.rid or ""
        inputs = [
            self._input(body, p, sp, tenant, rid)
            for p, sp in zip(prompts, params_list, strict=True)
        ]
        runs: list[tuple[Generation, SamplingParamsBody]] = []
        for inp in inputs:
            await check_grammar(self._frontend, inp)  # a bad grammar: 400 before any work
        try:
            for inp, sp in zip(inputs, params_list, strict=True):
                runs.append((Generation(self._frontend, inp), sp))
        except BaseException:
            for gen, _ in runs:
                gen.cancel("another prompt of the batch was refused")
            raise
        if body.stream:
            if batched:
                for gen, _ in runs:
                    gen.cancel("a batch cannot stream")
                raise HttpError(400, "stream one prompt at a time")
            gen, sp = runs[0]
            events = await unless_disconnected(request, primed(self._stream(body, gen, sp)))
            return StreamingResponse(
                sse_stream(events), media_type="text/event-stream", headers=SSE_HEADERS
            )
        outs = await unless_disconnected(
            request,
            asyncio.gather(*(self._collect(body, g, sp) for g, sp in runs), return_exceptions=True),
        )
        for out in outs:
            if isinstance(out, BaseException):
                for gen, _ in runs:
                    gen.cancel("another prompt of the batch failed")
                raise out
        return JSONResponse(outs if batched else outs[0])

    def _prompts(self, body: GenerateBody) -> tuple[list[dict[str, Any]], bool]:
        if (body.text is None) == (body.input_ids is None):
            raise HttpError(400, "give text or input_ids (exactly one)")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            prompts = [{"prompt_text": check_text(t, "text")} for t in texts]
            batched = not isinstance(body.text, str)
        else:
            ids = body.input_ids or []
            batched = bool(ids) and isinstance(ids[0], list)
            prompts = [{"prompt_ids": list(p)} for p in (ids if batched else [ids])]  # type: ignore[arg-type]
        if not prompts or len(prompts) > self._max_batch:
            raise HttpError(400, f"give 1 to {self._max_batch} prompts")
        return prompts, batched

    def _input(
        self,
        body: GenerateBody,
        prompt: dict[str, Any],
        sp: SamplingParamsBody,
        tenant: str,
        rid: str,
    ) -> GenerateInput:
        for name in _UNSUPPORTED:
            if getattr(sp, name):
                raise HttpError(400, f"sampling_params.{name} is not supported", param=name)
        if sp.n != 1 or sp.min_new_tokens or sp.min_p:
            raise HttpError(400, "sampling_params: n must be 1; min_new_tokens and min_p 0")
        grammar = _grammar_of(sp)
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        sampling: dict[str, Any] = {
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": max(0, sp.top_k),
            "seed": sp.seed,
            "stop_token_ids": tuple(sp.stop_token_ids or ()),
            "ignore_eos": sp.ignore_eos,
            "repetition_penalty": sp.repetition_penalty,
            "frequency_penalty": sp.frequency_penalty,
            "presence_penalty": sp.presence_penalty,
        }
        if grammar is not None:
            sampling["grammar"] = grammar
        if body.return_logprob:
            sampling["logprobs"] = body.top_logprobs_num
            if body.logprob_start_len >= 0:
                sampling["prompt_logprobs"] = body.top_logprobs_num
        return GenerateInput(
            **prompt,
            tenant=tenant,
            max_tokens=max(1, sp.max_new_tokens),  # 0: prefill only, no tokens returned
            sampling=sampling,
            stop=tuple(check_text(s, "stop") for s in stop),
            skip_special_tokens=sp.skip_special_tokens,
            logprob_start=max(0, body.logprob_start_len),
            request_id=rid,
        )

    async def _stream(
        self, body: GenerateBody, gen: Generation, sp: SamplingParamsBody
    ) -> AsyncIterator[bytes]:
        text, ids, lps = "", [], []
        async for c in gen.chunks():
            if sp.max_new_tokens == 0:
                continue
            text, ids, lps = text + c.text, ids + c.token_ids, lps + c.logprobs
            yield sse(
                {
                    "text": text,
                    "output_ids": ids,
                    "meta_info": self._meta(body, gen, ids, lps, False),
                }
            )
        yield sse(
            {"text": text, "output_ids": ids, "meta_info": self._meta(body, gen, ids, lps, True)}
        )

    async def _collect(
        self, body: GenerateBody, gen: Generation, sp: SamplingParamsBody
    ) -> dict[str, Any]:
        parts = [c async for c in gen.chunks()]
        if sp.max_new_tokens == 0:
            parts = []
        ids = [t for c in parts for t in c.token_ids]
        lps = [lp for c in parts for lp in c.logprobs]
        text = "".join(c.text for c in parts)
        return {"text": text, "output_ids": ids, "meta_info": self._meta(body, gen, ids, lps, True)}

    def _meta(
        self,
        body: GenerateBody,
        gen: Generation,
        ids: list[int],
        lps: list[TokenLogprob],
        done: bool,
    ) -> dict[str, Any]:
        u = gen.usage()
        meta: dict[str, Any] = {
            "id": gen.request_id,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": u.cached_tokens,
            "finish_reason": self._finish(gen, ids) if done else None,
            "e2e_latency": u.e2e_s,
        }
        if body.return_logprob:
            with_text = body.return_text_in_logprobs
            meta["output_token_logprobs"] = [
                self._entry(lp.token_id, lp.logprob, with_text) for lp in lps
            ]
            meta["output_top_logprobs"] = [self._tops(lp, with_text) for lp in lps]
            if done:
                meta.update(self._input_logprobs(body, gen, with_text))
        return meta

    def _finish(self, gen: Generation, ids: list[int]) -> dict[str, Any]:
        if gen.finish_reason == "stop":
            matched: Any = gen.stopped if gen.stopped is not None else (ids[-1] if ids else None)
            return {"type": "stop", "matched": matched}
        return {"type": "length", "length": len(ids)}

    def _input_logprobs(
        self, body: GenerateBody, gen: Generation, with_text: bool
    ) -> dict[str, Any]:
        if body.logprob_start_len < 0:
            return {"input_token_logprobs": [], "input_top_logprobs": []}
        prompt = gen.state.prompt_ids or []
        start, lps = gen.prompt_logprobs
        by_pos = {start + i: lp for i, lp in enumerate(lps)}
        entries, tops = [], []
        for pos in range(min(body.logprob_start_len, len(prompt)), len(prompt)):
            lp = by_pos.get(pos)
            entries.append(self._entry(prompt[pos], None if lp is None else lp.logprob, with_text))
            tops.append(None if lp is None else self._tops(lp, with_text))
        return {"input_token_logprobs": entries, "input_top_logprobs": tops}

    def _entry(self, token_id: int, logprob: float | None, with_text: bool) -> list[Any]:
        return [logprob, token_id, self._text(token_id) if with_text else None]

    def _tops(self, lp: TokenLogprob, with_text: bool) -> list[list[Any]]:
        return [self._entry(t, v, with_text) for t, v in lp.top]
