"""Incremental detokenization: text deltas for a growing list of token ids, with stop strings.

Text comes from tokenizers' DecodeStream (`Tokenizer.decode_stream`), so each token costs a
constant amount of work (a 4096-token answer is a few milliseconds, not a quadratic re-decode),
and it comes out in whole characters: a token that ends inside a multi-byte UTF-8 character is
held until the character completes, so a stop string can never split one; at the end of
the stream `flush()` gives the bytes of an unfinished character as U+FFFD, as `decode` does.
Special tokens are left out of the text unless `skip_special_tokens=False`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvflow.stages.engine import Tokenizer


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas, stopping at the first stop string.

    `add(ids)` returns the new text that is safe to send: text that might be the start of a
    stop string is held back until it is clearly not one. When a stop string appears, the text
    before it (plus the stop string itself with `include_stop`) is the last delta, `stopped`
    names the stop string, `num_tokens` counts the ids up to the one that completed it, and
    later ids are ignored; the caller ends (aborts) the request with finish_reason "stop".
    `flush()` returns what is still held back once generation ended (U+FFFD for the bytes of an
    unfinished character, so no byte the model produced vanishes from the text).
    Not thread-safe (one per request)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stream = tokenizer.decode_stream(skip_special_tokens=skip_special_tokens)
        self._stops = tuple(dict.fromkeys(stop))
        self._include_stop = include_stop
        self._firsts = frozenset(stop[0] for stop in self._stops)
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._pending = ""  # decoded but not yet sent: a possible start of a stop string
        self.stopped: str | None = None
        self._sent: list[str] = []  # the deltas returned so far (joined on demand)
        self.num_tokens = 0  # ids consumed, up to the one that completed a stop string

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed generated ids; returns the text delta to send now (maybe "")."""
        if self.stopped is not None:
            return ""
        for token_id in token_ids:
            self.num_tokens += 1
            self._pending += self._stream.step(token_id)
            if self._stops and self._cut_at_stop():
                return self._send(len(self._pending))
        hold = self._held_back() if self._stops else 0
        return self._send(len(self._pending) - hold)

    def flush(self) -> str:
        """Everything still held once generation ended: text held back as a possible stop
        string, and the ids of an unfinished or invalid trailing UTF-8 sequence, decoded
        with U+FFFD as `Tokenizer.decode` would. Cut at a stop string it completes."""
        if self.stopped is not None:
            return ""
        self._pending += self._stream.flush()
        if self._stops:
            self._cut_at_stop()
        return self._send(len(self._pending))

    @property
    def text(self) -> str:
        """Everything sent so far (the concatenation of the deltas)."""
        return "".join(self._sent)

    def _send(self, n: int) -> str:
        delta, self._pending = self._pending[:n], self._pending[n:]
        if delta:
            self._sent.append(delta)
        return delta

    def _cut_at_stop(self) -> bool:
        """Cut the pending text at the earliest complete stop string, if there is one."""
        pending = self._pending
        if not any(stop in pending for stop in self._stops):
            return False
        index, stop = min((pending.find(s), s) for s in self._stops if s in pending)
        self._pending = pending[: index + (len(stop) if self._include_stop else 0)]
        self.stopped = stop
        return True

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that starts some stop string."""
        pending = self._pending
        for i in range(max(0, len(pending) - self._longest + 1), len(pending)):
            if pending[i] in self._firsts:
                tail = pending[i:]
                if any(stop.startswith(tail) for stop in self._stops):
                    return len(pending) - i
        return 0
