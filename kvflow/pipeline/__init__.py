"""kvflow.pipeline: the stage runtime, request context, tracing and metrics.

Nothing here knows about LLMs, and nothing here imports the rest of kvflow.
"""

from __future__ import annotations

from kvflow.pipeline.admission import (
    AdmissionConfig,
    AdmissionQueue,
    Priority,
    QueueFull,
    Ticket,
)
from kvflow.pipeline.channel import OutputChannel
from kvflow.pipeline.config import PipelineConfig
from kvflow.pipeline.context import RequestContext, SpanHandle
from kvflow.pipeline.errors import (
    DeadlineExceeded,
    FinalError,
    Overloaded,
    PipelineClosed,
    PipelineError,
    RequestCancelled,
    StageError,
)
from kvflow.pipeline.health import Health, LoopPulse
from kvflow.pipeline.metrics import (
    LATENCY_BUCKETS_S,
    Metrics,
    MetricsServer,
    PipelineMetrics,
    serve_metrics,
)
from kvflow.pipeline.run import RequestHandle
from kvflow.pipeline.runtime import Pipeline
from kvflow.pipeline.spans import RequestTrace, Span, Tracer, TraceStatus
from kvflow.pipeline.stage import FunctionStage, Stage
from kvflow.pipeline.tracing import (
    ProcessTraces,
    StageStats,
    format_breakdown,
    from_chrome_trace,
    load_traces,
    stage_breakdown,
    to_chrome_trace,
    to_chrome_trace_by_process,
    traces_from_dict,
    traces_to_dict,
    write_chrome_trace,
)

__all__ = [
    "LATENCY_BUCKETS_S",
    "AdmissionConfig",
    "AdmissionQueue",
    "DeadlineExceeded",
    "FinalError",
    "FunctionStage",
    "Health",
    "LoopPulse",
    "Metrics",
    "MetricsServer",
    "OutputChannel",
    "Overloaded",
    "Pipeline",
    "PipelineClosed",
    "PipelineConfig",
    "PipelineError",
    "PipelineMetrics",
    "Priority",
    "ProcessTraces",
    "QueueFull",
    "RequestCancelled",
    "RequestContext",
    "RequestHandle",
    "RequestTrace",
    "Span",
    "SpanHandle",
    "Stage",
    "StageError",
    "StageStats",
    "Ticket",
    "TraceStatus",
    "Tracer",
    "format_breakdown",
    "from_chrome_trace",
    "load_traces",
    "serve_metrics",
    "stage_breakdown",
    "to_chrome_trace",
    "to_chrome_trace_by_process",
    "traces_from_dict",
    "traces_to_dict",
    "write_chrome_trace",
]
