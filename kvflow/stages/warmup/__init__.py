"""Offline cache warm-up jobs: prefill a corpus into the cache at background priority.

``corpus`` parses the input formats, ``job`` holds the records, ``store`` keeps a job's
progress on disk, ``runner`` computes the items through a frontend's pipeline, ``coverage``
reads what is cached, ``manager`` ties them together for the gRPC service (api/warmup.py).
"""

from __future__ import annotations

from kvflow.stages.warmup.corpus import CorpusError, CorpusFile, CorpusItem, parse_corpus
from kvflow.stages.warmup.job import Budget, ItemResult, ItemState, JobOptions, JobState
from kvflow.stages.warmup.manager import WarmupManager
from kvflow.stages.warmup.target import WarmTarget

__all__ = [
    "Budget",
    "CorpusError",
    "CorpusFile",
    "CorpusItem",
    "ItemResult",
    "ItemState",
    "JobOptions",
    "JobState",
    "WarmTarget",
    "WarmupManager",
    "parse_corpus",
]
