"""Incremental detokenization: text deltas for a growing list of token ids."""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.stages.engine import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas. A byte-level token may end in the middle of
    a UTF-8 character; such a tail (decoded as U+FFFD) is held back until it completes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = 0

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tokenizer.decode(self._ids)
        stable = len(text.rstrip(_REPLACEMENT)) if text.endswith(_REPLACEMENT) else len(text)
        if stable <= self._sent:
            return ""
        delta, self._sent = text[self._sent : stable], stable
        return delta

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids)
        delta, self._sent = text[self._sent :], len(text)
        return delta
