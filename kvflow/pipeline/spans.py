"""Span records, request traces and the ring buffer that keeps the finished ones.

A ``Span`` is one timed piece of a request: a stage (``parent is None``) or a child span opened
inside one (``ctx.span(...)``). A ``RequestTrace`` is every span of one finished request. The
``Tracer`` keeps the last ``capacity`` traces. Times are seconds of the request context's clock
(monotonic by default); only differences between them mean anything.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

NATIVE_FORMAT = "kvflow-traces"
NATIVE_VERSION = 1


class TraceStatus(StrEnum):
    """How a request ended."""

    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    CLOSED = "closed"


@dataclass(frozen=True)
class Span:
    """One finished span.

    Attributes:
        name: the stage name for a stage span, the child's name for a child span.
        start_s: start time in seconds of the context's clock.
        duration_s: how long it lasted, seconds (>= 0).
        attrs: JSON-able attributes (blocks hit, bytes moved, error type...). Treat as read-only.
        parent: ``span_id`` of the enclosing span within the same trace; None for a stage span.
        span_id: id unique within its ``RequestTrace`` (assigned in opening order from 1).
        stage: the stage lane the span belongs to (its own name for a stage span).
    """

    name: str
    start_s: float
    duration_s: float
    attrs: Mapping[str, Any] = field(default_factory=dict)
    parent: int | None = None
    span_id: int = 0
    stage: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start_s": self.start_s,
            "duration_s": self.duration_s,
            "attrs": json_safe(dict(self.attrs)),
            "parent": self.parent,
            "span_id": self.span_id,
            "stage": self.stage,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Span:
        """Inverse of ``to_dict``; raises ValueError naming a missing or ill-typed field."""
        try:
            return cls(
                name=str(data["name"]),
                start_s=float(data["start_s"]),
                duration_s=float(data["duration_s"]),
                attrs=dict(data.get("attrs") or {}),
                parent=None if data.get("parent") is None else int(data["parent"]),
                span_id=int(data.get("span_id", 0)),
                stage=str(data.get("stage", data["name"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad span record {dict(data)!r}: {exc!r}") from exc


@dataclass(frozen=True)
class RequestTrace:
    """Every span of one finished request, in opening order.

    Attributes:
        request_id: the request's id.
        spans: its spans; stage spans have ``parent is None``.
        status: how the request ended.
        error: ``"Type: message"`` of the error it ended with, or None.
        attrs: request-level attributes (``ctx.set_attr`` outside any stage).
    """

    request_id: str
    spans: tuple[Span, ...] = ()
    status: TraceStatus = TraceStatus.OK
    error: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def stage_spans(self) -> list[Span]:
        """The top-level spans (one per stage entered, plus spawned children)."""
        return [span for span in self.spans if span.parent is None]

    def span_path(self, span: Span) -> str:
        """``stage/child/grandchild`` names from the top-level span down to ``span``."""
        by_id = {s.span_id: s for s in self.spans}
        names = [span.name]
        current = span
        while current.parent is not None and current.parent in by_id:
            current = by_id[current.parent]
            names.append(current.name)
        return "/".join(reversed(names))

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "status": str(self.status),
            "error": self.error,
            "attrs": json_safe(dict(self.attrs)),
            "spans": [span.to_dict() for span in self.spans],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestTrace:
        """Inverse of ``to_dict``; raises ValueError naming what is wrong."""
        try:
            return cls(
                request_id=str(data["request_id"]),
                spans=tuple(Span.from_dict(s) for s in data.get("spans", ())),
                status=TraceStatus(data.get("status", "ok")),
                error=data.get("error"),
                attrs=dict(data.get("attrs") or {}),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"bad request trace record: {exc!r}") from exc


class Tracer:
    """A ring buffer of the last ``capacity`` finished ``RequestTrace`` objects.

    Thread-safe: ``record`` may be called from the event loop while an admin thread reads.
    Recording into a full buffer drops the oldest trace and counts it in ``dropped``.
    """

    def __init__(self, capacity: int = 1024) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._traces: deque[RequestTrace] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._dropped = 0

    def record(self, trace: RequestTrace) -> None:
        """Append a finished trace (mutates the buffer)."""
        if not isinstance(trace, RequestTrace):
            raise TypeError(f"Tracer.record expects a RequestTrace, got {type(trace).__name__}")
        with self._lock:
            if len(self._traces) == self.capacity:
                self._dropped += 1
            self._traces.append(trace)

    def traces(
        self, last: int | None = None, where: Callable[[RequestTrace], bool] | None = None
    ) -> list[RequestTrace]:
        """A copy of the kept traces, oldest first; only those ``where`` accepts (e.g. one
        tenant's), and of them only the newest ``last`` when given."""
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 0):
            raise ValueError(f"last must be an int >= 0 or None, got {last!r}")
        with self._lock:
            kept = list(self._traces)
        if where is not None:
            kept = [t for t in kept if where(t)]
        if last is None:
            return kept
        return kept[len(kept) - last :] if last else []

    def find(self, request_id: str) -> RequestTrace | None:
        """The newest kept trace of ``request_id``, or None."""
        with self._lock:
            for trace in reversed(self._traces):
                if trace.request_id == request_id:
                    return trace
        return None

    def clear(self) -> None:
        """Forget every kept trace and reset ``dropped``."""
        with self._lock:
            self._traces.clear()
            self._dropped = 0

    @property
    def dropped(self) -> int:
        """Traces pushed out of the ring since creation or the last ``clear``."""
        with self._lock:
            return self._dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._traces)


def traces_to_dict(traces: Iterable[RequestTrace]) -> dict[str, Any]:
    """The native JSON form: ``{"format": "kvflow-traces", "version": 1, "traces": [...]}``."""
    return {
        "format": NATIVE_FORMAT,
        "version": NATIVE_VERSION,
        "traces": [trace.to_dict() for trace in traces],
    }


def traces_from_dict(data: Mapping[str, Any]) -> list[RequestTrace]:
    """Inverse of ``traces_to_dict``; raises ValueError if ``data`` is not that form."""
    if data.get("format") != NATIVE_FORMAT:
        raise ValueError(f"not a kvflow trace document (format={data.get('format')!r})")
    if data.get("version") != NATIVE_VERSION:
        raise ValueError(f"unsupported kvflow trace version {data.get('version')!r}")
    return [RequestTrace.from_dict(t) for t in data.get("traces", ())]


def json_safe(value: Any) -> Any:
    """``value`` made strictly JSON-serialisable.

    Containers are converted recursively (tuples and sets become lists, mapping keys become
    str); NaN and infinities and every other type become their ``str``. Does not mutate.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(v) for v in value]
    return str(value)
