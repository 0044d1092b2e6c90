"""One group of instances' load as numpy arrays, re-read only where an instance changed.

The conductor used to take one :class:`~kvflow.router.instances.InstanceSnapshot` per instance
per decision (a Python call and a tuple each: ~1 us, so ~130 us per decision at 64 + 64
instances). A :class:`LoadTable` mirrors an ordered group of :class:`InstanceState` objects as
arrays; a read compares the instances' ``version`` counters and re-reads only the ones that moved
(:meth:`InstanceState.load_terms`), then computes every queue's remaining seconds at ``now`` with
a few array operations.

The values are bit-identical to the snapshots': a running request's remainder is
``max(0.0, predicted - (now - started))`` and a queue's seconds are summed in the snapshot's
order (``waiting``, then each running entry in start order, then the external load). Rows are
padded with entries that add exactly ``0.0``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvflow.router.instances import InstanceKind, InstanceState, LoadTerms

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_version_of = attrgetter("version")


class LoadArrays(NamedTuple):
    """The healthy instances of a group at one ``now``, in the group's order.

    Arrays are fresh or never mutated again: the reader owns them and must not mutate them.
    """

    instance_ids: tuple[str, ...]
    queued_requests: IntArray
    queued_seconds: FloatArray
    decode_batch_size: IntArray
    decode_context_tokens: IntArray


class LoadTable:
    """Arrays of the load of ``states`` (one kind, in order). Thread-safe: :meth:`read`
    serialises on an internal lock. ValueError when a state is not of ``kind``."""

    def __init__(self, states: Sequence[InstanceState], kind: InstanceKind) -> None:
        for state in states:
            if state.kind is not kind:
                raise ValueError(
                    f"instance {state.instance_id!r} is {state.kind.value}, expected {kind.value}"
                )
        self.states = tuple(states)
        n = len(self.states)
        self._ids = tuple(s.instance_id for s in self.states)
        self._versions: list[int] = [-1] * n
        self._healthy = np.zeros(n, dtype=bool)
        self._queued_requests = np.zeros(n, dtype=np.int64)
        self._waiting = np.zeros(n, dtype=np.float64)
        self._external = np.zeros(n, dtype=np.float64)
        self._static_seconds = np.zeros(n, dtype=np.float64)  # waiting + external
        self._batch = np.zeros(n, dtype=np.int64)
        self._context = np.zeros(n, dtype=np.int64)
        self._running: dict[int, tuple[tuple[float, float], ...]] = {}
        self._run_rows = np.zeros(0, dtype=np.int64)
        self._run_predicted = np.zeros((0, 0), dtype=np.float64)
        self._run_started = np.zeros((0, 0), dtype=np.float64)
        self._healthy_view: tuple[tuple[str, ...], IntArray | None] = ((), None)
        self._lock = threading.Lock()

    def serves(self, states: Sequence[InstanceState]) -> bool:
        """Whether ``states`` are this table's instances (the same objects, in order)."""
        if len(states) != len(self.states):
            return False
        return (states if isinstance(states, tuple) else tuple(states)) == self.states

    def read(self, now: float | None) -> LoadArrays:
        """The healthy instances' load at ``now`` (see :meth:`InstanceState.snapshot`)."""
        with self._lock:
            versions = list(map(_version_of, self.states))
            if versions != self._versions:
                self._refresh(versions)
            seconds = self._queued_seconds(now)
            ids, rows = self._healthy_view
            if rows is None:
                return LoadArrays(ids, self._queued_requests, seconds, self._batch, self._context)
            return LoadArrays(
                ids, self._queued_requests[rows], seconds[rows], self._batch[rows],
                self._context[rows],
            )  # fmt: skip

    # --- internals (under the lock) -------------------------------------------------------------
    def _refresh(self, versions: list[int]) -> None:
        changed = [
            i for i, (a, b) in enumerate(zip(versions, self._versions, strict=True)) if a != b
        ]
        # copy on write: arrays handed out by earlier reads are never mutated
        self._healthy = self._healthy.copy()
        self._queued_requests = self._queued_requests.copy()
        self._waiting = self._waiting.copy()
        self._external = self._external.copy()
        self._static_seconds = self._static_seconds.copy()
        self._batch = self._batch.copy()
        self._context = self._context.copy()
        running_moved = False
        for i in changed:
            terms = self.states[i].load_terms()
            self._store(i, terms)
            if terms.running or i in self._running:
                running_moved = True
                if terms.running:
                    self._running[i] = terms.running
                else:
                    del self._running[i]
        if running_moved:
            self._pad_running()
        healthy_rows = self._healthy.nonzero()[0]
        if len(healthy_rows) == len(self.states):
            self._healthy_view = (self._ids, None)
        else:
            ids = tuple(self._ids[i] for i in healthy_rows.tolist())
            self._healthy_view = (ids, healthy_rows)

    def _store(self, i: int, terms: LoadTerms) -> None:
        self._versions[i] = terms.version
        self._healthy[i] = terms.healthy
        self._queued_requests[i] = terms.queued_requests
        self._waiting[i] = terms.waiting_s
        self._external[i] = terms.external_s
        self._static_seconds[i] = terms.waiting_s + terms.external_s
        self._batch[i] = terms.decode_batch_size
        self._context[i] = terms.decode_context_tokens

    def _pad_running(self) -> None:
        rows = sorted(self._running)
        width = max((len(self._running[r]) for r in rows), default=0)
        # padding: predicted 0.0, started -inf => max(0.0, 0.0 - inf) = 0.0, and 0.0 without now
        predicted = np.zeros((len(rows), width), dtype=np.float64)
        started = np.full((len(rows), width), -np.inf, dtype=np.float64)
        for at, row in enumerate(rows):
            for k, (p, s) in enumerate(self._running[row]):
                predicted[at, k] = p
                started[at, k] = s
        self._run_rows = np.array(rows, dtype=np.int64)
        self._run_predicted = predicted
        self._run_started = started

    def _queued_seconds(self, now: float | None) -> FloatArray:
        if not len(self._run_rows):
            return self._static_seconds
        rows = self._run_rows
        if now is None:
            remaining = self._run_predicted
        else:
            remaining = np.maximum(0.0, self._run_predicted - (now - self._run_started))
        total = self._waiting[rows]  # a copy (fancy indexing)
        for k in range(remaining.shape[1]):  # the snapshot's order of additions
            total += remaining[:, k]
        total += self._external[rows]
        seconds = self._static_seconds.copy()
        seconds[rows] = total
        return seconds
