"""Per-request state, kept as counters (vLLM v1 style) so prefix reuse, chunked prefill and
decode are one loop: KV exists for `token_ids[:num_computed]`; the rest is to compute.

A sequence with more than one uncomputed token is in prefill; with exactly one (the last
sampled token, or the last prompt token after an imported prefix) it is in decode.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from kvflow.stages.engine.config import SamplingParams
from kvflow.stages.engine.grammar import Constraint


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request; owned by the engine thread."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    sampling: SamplingParams
    pages: list[int]
    num_computed: int
    stop_ids: frozenset[int]
    max_len: int
    retain_pages: bool
    arrival: int
    generator: torch.Generator | None = None
    num_generated: int = 0
    finish_reason: FinishReason | None = None
    last_decode_step: int = -1
    page_table: torch.Tensor | None = field(default=None, repr=False)
    constraint: Constraint | None = field(default=None, repr=False)
    block_keys: tuple[Hashable, ...] = field(default=(), repr=False)  # of full prompt blocks

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def phase(self) -> Phase:
        if self.finish_reason is not None:
            return Phase.FINISHED
        return Phase.DECODE if self.remaining == 1 else Phase.PREFILL

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token; returns (and records) the finish reason if it ends here."""
        self.token_ids.append(token)
        self.num_generated += 1
        grammar_done = False
        if self.constraint is not None:
            self.constraint.accept(token)
            grammar_done = self.constraint.terminated
        if token in self.stop_ids or grammar_done:
            self.finish_reason = FinishReason.STOP
        elif self.num_generated >= self.sampling.max_tokens or len(self.token_ids) >= self.max_len:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability under the model's raw distribution (before penalties,
    temperature, top-k, top-p). rank: 1 = the most likely token. top: the n most likely
    (token id, logprob), best first (n = SamplingParams.logprobs / prompt_logprobs)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What one `step()` did for one request.

    Fields:
        request_id: the id given to add_request.
        new_token_ids: tokens sampled in this step (0 or 1 today).
        finished / finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or
            max_model_len), "abort" (engine.abort); None while running.
        num_computed_tokens: tokens whose KV is in the request's pages after this step.
        completed_blocks: indices of the request's pages that became full (block_size tokens
            computed) during this step, in order; export them with engine.export_page.
        logits: float32 [len(new_token_ids), vocab] logits each new token was sampled from,
            only when EngineConfig.return_logits.
        logprobs: one TokenLogprob per new token when SamplingParams.logprobs is set.
        prompt_logprobs: when SamplingParams.prompt_logprobs is set, one TokenLogprob per
            prompt token this step's prefill chunk scored, for positions
            prompt_logprobs_start, prompt_logprobs_start + 1, ... of the prompt. Over a
            request's steps they cover positions num_prefix_tokens + 1 .. prompt_len - 1:
            a token's logprob needs the previous position's output, which an imported
            (cached) prefix never computes here.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_computed_tokens: int
    completed_blocks: tuple[int, ...]
    logits: torch.Tensor | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs_start: int = 0
