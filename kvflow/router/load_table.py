"""One group of instances' load as numpy arrays, re-read only where an instance changed.

The conductor used to take one :class:`~kvflow.router.instances.InstanceSnapshot` per instance
per decision (a Python call and a tuple each: ~1 us, so ~130 us per decision at 64 + 64
instances). A :class:`LoadTable` mirrors an ordered group of :class:`InstanceState` objects as
arrays. It watches its instances (:meth:`InstanceState.watch`): a mutation only marks the
instance dirty, and a read re-reads the dirty ones (:meth:`InstanceState.load_terms`) and then
computes every queue's remaining seconds at ``now`` with a few array operations, whatever the
number of instances.

The values are bit-identical to the snapshots': a running request's remainder is
``max(0.0, predicted - (now - started))`` and a queue's seconds are summed in the snapshot's
order (``waiting``, then each running entry in start order, then the external load): one
column of running entries at a time. Rows are padded with entries that add exactly ``0.0``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from kvflow.router.instances import ChangeSet, InstanceKind, InstanceState, LoadTerms

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class LoadArrays(NamedTuple):
    """The healthy instances of a group at one ``now``, in the group's order; ``positions``
    maps an instance id to its position (None when an id repeats). The reader must not mutate
    any of it (arrays handed out are never mutated by the table either)."""

    instance_ids: tuple[str, ...]
    positions: dict[str, int] | None
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
        self._prefill = kind is InstanceKind.PREFILL  # the other kind's columns stay 0
        n = len(self.states)
        self._rows: dict[InstanceState, list[int]] = {}
        for row, state in enumerate(self.states):
            self._rows.setdefault(state, []).append(row)
        self._ids = tuple(s.instance_id for s in self.states)
        self._healthy = np.zeros(n, dtype=bool)
        self._queued_requests = np.zeros(n, dtype=np.int64)
        self._external = np.zeros(n, dtype=np.float64)
        self._batch = np.zeros(n, dtype=np.int64)
        self._context = np.zeros(n, dtype=np.int64)
        # column 0: waiting seconds; columns 1..: running entries (predicted, started), padded
        # with (0.0, -inf): max(0.0, 0.0 - (now + inf)) = 0.0, and 0.0 without ``now``
        self._predicted = np.zeros((n, 1), dtype=np.float64)
        self._started = np.full((n, 1), -np.inf, dtype=np.float64)
        self._running = [0] * n  # running entries per row
        self._any_running = 0  # rows with running entries
        self._static: FloatArray | None = None  # waiting + external, valid while none runs
        self._view: tuple[tuple[str, ...], dict[str, int] | None, IntArray | None] = ((), {}, None)
        self._dirty = ChangeSet(self.states)  # instances add themselves when they change
        self._lock = threading.Lock()
        for state in self._rows:
            state.watch(self._dirty)

    def serves(self, states: Sequence[InstanceState]) -> bool:
        """Whether ``states`` are this table's instances (the same objects, in order)."""
        if len(states) != len(self.states):
            return False
        return (states if isinstance(states, tuple) else tuple(states)) == self.states

    def read(self, now: float | None) -> LoadArrays:
        """The healthy instances' load at ``now`` (see :meth:`InstanceState.snapshot`)."""
        with self._lock:
            if self._dirty:
                self._refresh()
            seconds = self._queued_seconds(now)
            ids, positions, rows = self._view
            if rows is None:
                return LoadArrays(
                    ids, positions, self._queued_requests, seconds, self._batch, self._context
                )
            return LoadArrays(
                ids, positions, self._queued_requests[rows], seconds[rows], self._batch[rows],
                self._context[rows],
            )  # fmt: skip

    # --- internals (under the lock) -------------------------------------------------------------
    def _refresh(self) -> None:
        # copy on write: arrays handed out by earlier reads are never mutated
        if self._prefill:
            self._queued_requests = self._queued_requests.copy()
            self._static = None
        else:
            self._batch = self._batch.copy()
            self._context = self._context.copy()
        health_moved = False
        dirty = self._dirty
        while dirty:
            try:
                state = dirty.pop()  # a mutation may add more meanwhile: read until none is left
            except KeyError:
                break
            terms = state.load_terms()
            for row in self._rows[state]:
                health_moved |= bool(self._healthy[row]) != terms.healthy
                self._store(row, terms)
        if health_moved or not self._view[0]:
            rows = self._healthy.nonzero()[0]
            if len(rows) == len(self.states):
                self._view = (self._ids, _positions(self._ids), None)
            else:
                ids = tuple(self._ids[r] for r in rows.tolist())
                self._view = (ids, _positions(ids), rows)

    def _store(self, row: int, terms: LoadTerms) -> None:
        self._healthy[row] = terms.healthy
        if self._prefill:
            self._store_queue(row, terms)
        else:
            self._batch[row] = terms.decode_batch_size
            self._context[row] = terms.decode_context_tokens

    def _store_queue(self, row: int, terms: LoadTerms) -> None:
        self._queued_requests[row] = terms.queued_requests
        self._external[row] = terms.external_s
        running = terms.running
        width = self._predicted.shape[1] - 1
        if len(running) > width:
            self._widen(len(running))
        predicted, started = self._predicted[row], self._started[row]
        predicted[0] = terms.waiting_s
        for k in range(len(running), self._running[row]):  # clear what ran before
            predicted[k + 1] = 0.0
            started[k + 1] = -np.inf
        for k, (p, s) in enumerate(running):
            predicted[k + 1] = p
            started[k + 1] = s
        self._any_running += (len(running) > 0) - (self._running[row] > 0)
        self._running[row] = len(running)

    def _widen(self, width: int) -> None:
        n = len(self.states)
        extra = width + 1 - self._predicted.shape[1]
        self._predicted = np.hstack([self._predicted, np.zeros((n, extra))])
        self._started = np.hstack([self._started, np.full((n, extra), -np.inf)])

    def _queued_seconds(self, now: float | None) -> FloatArray:
        if not self._any_running:
            if self._static is None:
                self._static = self._predicted[:, 0] + self._external
            return self._static
        predicted = self._predicted
        # column 0 (waiting, started -inf) comes out 0.0 with ``now``; it is read from predicted
        remaining = (
            predicted if now is None else np.maximum(0.0, predicted - (now - self._started))
        )
        total = predicted[:, 0] + remaining[:, 1]
        for k in range(2, predicted.shape[1]):  # left to right, as the snapshot sums
            total += remaining[:, k]
        total += self._external
        return total


def _positions(ids: tuple[str, ...]) -> dict[str, int] | None:
    positions = {instance_id: at for at, instance_id in enumerate(ids)}
    return positions if len(positions) == len(ids) else None
