"""tokenize: prompt text -> token ids with the model's own tokenizer.json; validates lengths."""

from __future__ import annotations

import asyncio
from typing import Any

from kvflow.pipeline import RequestContext, Stage
from kvflow.stages.engine import Tokenizer
from kvflow.stages.errors import InvalidArgument
from kvflow.stages.state import GenerateState

# Tokenizing more characters than this is moved off the event loop.
_INLINE_CHARS = 4096


class TokenizeStage(Stage):
    """Fills ``state.prompt_ids`` (or checks the ids the caller gave).

    Raises InvalidArgument for an empty prompt, ids outside the vocabulary, or a prompt that
    with ``max_tokens`` does not fit in ``max_model_len``.
    """

    name = "tokenize"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        # at start, not in the first request (its tokenize span was 87-113 ms on 2 cores):
        # the longest vocabulary string (a scan of the vocabulary) and a first encode
        if tokenizer.max_token_chars:
            tokenizer.encode_prompt("warm-up")

    async def run(self, ctx: RequestContext[Any]) -> None:
        state: GenerateState = ctx.state
        if state.prompt_ids is None:
            text = state.prompt_text or ""
            if not text:
                raise InvalidArgument("prompt is empty")
            self._check_chars(len(text), state.max_tokens)
            tok = self._tokenizer
            encode = tok.encode_prompt if state.add_special_tokens else tok.encode
            if len(text) > _INLINE_CHARS:
                ids = await asyncio.to_thread(encode, text)
            else:
                ids = encode(text)
            state.prompt_ids = list(ids)
        ids = state.prompt_ids
        if not ids:
            raise InvalidArgument("prompt is empty (no tokens)")
        bad = next((t for t in ids if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"token id {bad} is outside the vocabulary [0, {self._vocab_size})"
            )
        total = len(ids) + state.max_tokens
        if total > self._max_model_len:
            raise InvalidArgument(
                f"prompt of {len(ids)} tokens + max_tokens {state.max_tokens} = {total} exceeds "
                f"the model's maximum of {self._max_model_len} tokens"
            )
        ctx.set_attrs(prompt_tokens=len(ids))

    def _check_chars(self, chars: int, max_tokens: int) -> None:
        """Refuse a text that must have too many tokens, before tokenizing any of it."""
        at_least = -(-chars // self._tokenizer.max_token_chars)
        if at_least + max_tokens > self._max_model_len:
            raise InvalidArgument(
                f"prompt of {chars} characters has at least {at_least} tokens: with max_tokens "
                f"{max_tokens} it exceeds the model's maximum of {self._max_model_len} tokens"
            )
