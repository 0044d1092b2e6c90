"""GenerateState: what one Generate request carries from stage to stage.

Each stage fills its own group of fields; a field is None (or empty) until its stage ran.
Counters follow vLLM's habit: progress is counted in tokens (``num_cached_tokens``...).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvflow.kvdb import BlockKey, Namespace
from kvflow.router import RouteDecision
from kvflow.stages.engine import SamplingParams

if TYPE_CHECKING:
    from kvflow.stages.runtime.instances import DecodeInstance, PrefillInstance, StagingLease
    from kvflow.stages.stream import StreamTarget


@dataclass
class GenerateState:
    # -- the request as received ---------------------------------------------------------------
    tenant: str
    max_tokens: int
    sampling: SamplingParams
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    submitted_at: float = 0.0

    # -- tokenize / hash --------------------------------------------------------------------------
    namespace: Namespace | None = None
    block_keys: list[BlockKey] = field(default_factory=list)

    # -- route ---------------------------------------------------------------------------------
    decision: RouteDecision | None = None
    prefill: PrefillInstance | None = None
    decode: DecodeInstance | None = None

    # -- reuse-load -----------------------------------------------------------------------------
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    pulled_tokens: int = 0
    prefix_pages: list[Any] = field(default_factory=list)
    pinned_keys: list[BlockKey] = field(default_factory=list)
    load_lease: StagingLease | None = None

    # -- prefill / stream -------------------------------------------------------------------------
    engine_request_id: str = ""
    prefill_admitted: bool = False
    prefill_done: bool = False
    block_queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    first_token: int | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    staging: StagingLease | None = None
    stream_target: StreamTarget | None = None
    streamed_blocks: int = 0
    streamed_bytes: int = 0
    stored_blocks: int = 0

    # -- decode -------------------------------------------------------------------------------
    decode_admitted: bool = False
    decode_request_id: str = ""
    stored_decode_blocks: int = 0
    output_ids: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None

    @property
    def prompt_len(self) -> int:
        return 0 if self.prompt_ids is None else len(self.prompt_ids)
