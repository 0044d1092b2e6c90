"""One place for proto <-> records: the gRPC status of an error, sampling parameters, the
pull plan, the KV layout a node reports, and the trace context that travels in gRPC metadata.
Shared by the inference and node APIs (their messages use the same field names)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from kvflow.kvdb import KVLayout
from kvflow.pipeline import (
    DeadlineExceeded,
    Overloaded,
    PipelineClosed,
    QueueFull,
    RequestCancelled,
    StageError,
)
from kvflow.router import PullPlan
from kvflow.stages.api import node_pb2
from kvflow.stages.engine import GrammarSpec, SamplingParams, TokenLogprob
from kvflow.stages.errors import (
    InvalidArgument,
    NoCapacity,
    RateLimited,
    Rejected,
    StreamTargetFailed,
)

# gRPC metadata key of the trace context: "<request id>/<parent span name>".
TRACE_PARENT = "kvflow-trace-parent"


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and details for the error a request ended with."""
    if isinstance(error, InvalidArgument):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, Rejected | NoCapacity | Overloaded | RateLimited | QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, DeadlineExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error)
    if isinstance(error, RequestCancelled):
        return grpc.StatusCode.CANCELLED, str(error)
    if isinstance(error, PipelineClosed):
        return grpc.StatusCode.UNAVAILABLE, str(error)
    if isinstance(error, StreamTargetFailed):
        return grpc.StatusCode.ABORTED, str(error)  # the decode side's fault (node_client)
    if isinstance(error, StageError):
        if isinstance(error.cause, StreamTargetFailed):
            return grpc.StatusCode.ABORTED, f"stage {error.stage}: {error.cause}"
        return grpc.StatusCode.INTERNAL, f"stage {error.stage}: {error.cause!r}"
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def sampling_fields(msg: Any) -> dict[str, Any]:
    """SamplingParams keyword arguments (but max_tokens) of a Sampling / SamplingParams
    message (the inference and node APIs share the fields); proto zeros mean "off"."""
    return {
        "temperature": float(msg.temperature),
        "top_k": int(msg.top_k),
        # 0 is proto's "unset"; anything else (NaN and negatives too) is validated by
        # SamplingParams, never silently replaced.
        "top_p": float(msg.top_p) if msg.top_p != 0 else 1.0,
        "seed": int(msg.seed) if msg.HasField("seed") else None,
        "ignore_eos": bool(msg.ignore_eos),
        "stop_token_ids": tuple(int(t) for t in msg.stop_token_ids),
        "repetition_penalty": float(msg.repetition_penalty) if msg.repetition_penalty else 1.0,
        "frequency_penalty": float(msg.frequency_penalty),
        "presence_penalty": float(msg.presence_penalty),
        "logprobs": int(msg.logprobs) if msg.HasField("logprobs") else None,
        "prompt_logprobs": int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
        "logit_bias": tuple(sorted((int(k), float(v)) for k, v in msg.logit_bias.items())),
        "grammar": grammar_of(msg.grammar_kind, msg.grammar),
    }


def grammar_of(kind: str, source: str) -> GrammarSpec | None:
    """The GrammarSpec a message's grammar_kind / grammar fields state ("" kind: none); a bad
    kind or text is InvalidArgument."""
    if not kind:
        if source:
            raise InvalidArgument("grammar is set without grammar_kind")
        return None
    try:
        return GrammarSpec(kind, source)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def sampling_from(msg: Any, max_tokens: int) -> SamplingParams:
    """SamplingParams from a Sampling / SamplingParams message; a bad value is
    InvalidArgument naming it."""
    try:
        return SamplingParams(max_tokens=max_tokens, **sampling_fields(msg))
    except ValueError as exc:
        raise InvalidArgument(f"sampling: {exc}") from exc


def sampling_to_msg(s: SamplingParams) -> Any:
    """The node API's Sampling message of ``s`` (max_tokens travels beside it)."""
    msg = node_pb2.Sampling(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        stop_token_ids=s.stop_token_ids,
        repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
    )
    msg.ignore_eos = s.ignore_eos
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    for token, bias in s.logit_bias:
        msg.logit_bias[token] = bias
    if s.grammar is not None:
        msg.grammar_kind, msg.grammar = s.grammar.kind, s.grammar.source
    return msg


def logprobs_to_msgs(cls: Any, logprobs: Iterable[TokenLogprob]) -> list[Any]:
    """TokenLogprob messages (``cls``: the inference or node API's) of engine records."""
    return [
        cls(
            token_id=lp.token_id,
            logprob=lp.logprob,
            rank=lp.rank,
            top_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in logprobs
    ]


def logprobs_from_msgs(msgs: Iterable[Any]) -> list[TokenLogprob]:
    """Engine records of TokenLogprob messages (either API's)."""
    return [
        TokenLogprob(
            int(m.token_id),
            float(m.logprob),
            int(m.rank),
            tuple(
                zip((int(t) for t in m.top_ids), (float(v) for v in m.top_logprobs), strict=True)
            ),
        )
        for m in msgs
    ]


def pull_to_fields(pull: PullPlan | None, decided: bool) -> dict[str, Any]:
    """PrefillRequest fields carrying the conductor's pull plan."""
    fields: dict[str, Any] = {"pulls_decided": decided}
    if pull is not None:
        fields.update(
            pull_from=pull.from_instance,
            pull_start_block=pull.start_block,
            pull_num_blocks=pull.num_blocks,
        )
    return fields


def pull_from_msg(msg: Any) -> PullPlan | None:
    """The PrefillRequest's pull plan, or None; InvalidArgument for a malformed one."""
    if not msg.pull_from:
        return None
    if msg.pull_num_blocks <= 0:
        raise InvalidArgument("pull_num_blocks must be > 0 when pull_from is set")
    return PullPlan(msg.pull_from, int(msg.pull_start_block), int(msg.pull_num_blocks))


def layout_from_info(info: Any) -> KVLayout:
    """The KV layout a node's InfoReply describes."""
    return KVLayout(info.num_layers, info.num_kv_heads, info.head_dim, info.block_size, info.dtype)


def trace_parent(context: grpc.aio.ServicerContext) -> str:
    """The caller's trace context from the call's metadata ("" when none came)."""
    for key, value in context.invocation_metadata() or ():
        if key == TRACE_PARENT:
            return str(value)
    return ""
