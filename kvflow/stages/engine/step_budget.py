"""The prompt budget of a step that also decodes, sized to a target step time.

In an engine that both prefills and decodes (a colocated server), every running stream waits
for each step: a step's time is their time between tokens (TBT). A fixed token budget
(``mixed_chunk``) is a fixed cost only on the machine it was tuned on, and the cost of a
prompt token grows with the prompt's context. So the budget is derived from time:

    step seconds ~= base + per_token * prompt_tokens

``base`` is measured on steps that only decode, ``per_token`` on steps with prompt tokens
(what the step took beyond ``base``, per token), both as moving averages; a step's budget is
``(target - base) / per_token`` tokens, within ``[floor, ceiling]`` (the floor keeps a long
prompt moving on a slow machine; the ceiling is ``mixed_chunk``). With ``base`` not yet
measured (0), the budget still converges to a step of ``target``: each step's measure of
``per_token`` then includes ``base``, and the fixed point of ``P -> target * P / (base +
per_token * P)`` is the step of ``target`` seconds. Until a prompt token was measured the
budget is the floor.

Pure: the engine times its steps and reports them (``observe``); tests inject the times.
"""

from __future__ import annotations

MIN_FLOOR = 16
"""The least prompt tokens of a mixed step (at most the ceiling)."""

ALPHA = 0.3
"""Weight of the newest measurement in the moving averages."""


class StepBudget:
    """Prompt tokens for the next step that also decodes, so that it takes about
    ``target_s`` seconds. ``ceiling``: the most (``mixed_chunk``); ``floor``: the least
    (default ``MIN_FLOOR``, at most ``ceiling``)."""

    def __init__(self, target_s: float, ceiling: int, floor: int | None = None) -> None:
        if not target_s > 0:
            raise ValueError(f"target step time must be positive, got {target_s!r} s")
        if ceiling <= 0:
            raise ValueError(f"ceiling must be positive, got {ceiling}")
        self.target_s = target_s
        self.ceiling = ceiling
        self.floor = min(ceiling, MIN_FLOOR if floor is None else max(1, floor))
        self.base_s = 0.0  # a step that only decodes
        self.per_token_s: float | None = None  # one prompt token in a step

    def tokens(self) -> int:
        """The prompt budget of the next step that also decodes."""
        if self.per_token_s is None:
            return self.floor
        fit = int((self.target_s - self.base_s) / self.per_token_s)
        return max(self.floor, min(self.ceiling, fit))

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """A step of ``prompt_tokens`` prompt tokens and ``decode_rows`` decode rows took
        ``seconds``."""
        if seconds <= 0 or (prompt_tokens <= 0 and decode_rows <= 0):
            return
        if prompt_tokens <= 0:
            self.base_s = _average(self.base_s or None, seconds)
            return
        beyond = seconds - (self.base_s if decode_rows else 0.0)
        if beyond > 0:
            self.per_token_s = _average(self.per_token_s, beyond / prompt_tokens)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
