"""One group of instances' load as numpy arrays, re-read only where an instance changed.

The conductor used to take one :class:`~kvflow.router.instances.InstanceSnapshot` per instance
per decision (a Python call and a tuple each: ~1 us, so ~130 us per decision at 64 + 64
instances). A :class:`LoadTable` mirrors an ordered group of :class:`InstanceState` objects as
arrays. It watches its instances (:meth:`InstanceState.watch`): a mutation only adds the
instance to a change set, and a read re-reads those (:meth:`InstanceState.load_terms`).

Only queues with running requests depend on ``now``. With few of them their seconds are summed
in Python, with the snapshot's own expressions; with many (``MANY_RUNNING`` rows or more), in
numpy over a padded matrix of running entries, one column at a time. Either way the values are
bit-identical to the snapshots': a running request's remainder is
``max(0.0, predicted - (now - started))`` and a queue's seconds are summed in the snapshot's
order (``waiting``, then each running entry in start order, then the external load); padding
entries add exactly ``0.0``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvflow.router.candidates import DecodeGroups, FloatArray, IntArray
from kvflow.router.instances import ChangeSet, InstanceKind, InstanceState

MANY_RUNNING = 16
"""Rows with running requests from which their remainders are computed in numpy."""

# a row's running terms: (waiting seconds, ((predicted, started), ...), external seconds)
_Running = tuple[float, tuple[tuple[float, float], ...], float]


class LoadArrays(NamedTuple):
    """The healthy instances of a group at one ``now``, in the group's order; ``positions``
    maps an instance id to its position (None when an id repeats). The reader must not mutate
    any of it (arrays handed out are never mutated by the table either). A prefill group's
    decode columns, and a decode group's queue columns, are zeros."""

    instance_ids: tuple[str, ...]
    positions: dict[str, int] | None
    queued_requests: IntArray
    queued_seconds: FloatArray
    decode_batch_size: IntArray
    decode_context_tokens: IntArray
    decode_groups: DecodeGroups | None = None
    """The decode columns again as :data:`~kvflow.router.candidates.DecodeGroups`, when the
    group's owner keeps them (the simulator's ``SimLoads``; a ``LoadTable`` does not). Unlike
    the arrays it is the owner's live structure: valid until the owner's next change, so only
    the route call it is passed to may read it (the decision keeps nothing of it)."""


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
        self._prefill = kind is InstanceKind.PREFILL
        n = len(self.states)
        self._rows: dict[InstanceState, list[int]] = {}
        for row, state in enumerate(self.states):
            self._rows.setdefault(state, []).append(row)
        self._ids = tuple(s.instance_id for s in self.states)
        self._healthy = [False] * n
        self._queued_requests = np.zeros(n, dtype=np.int64)
        self._static = np.zeros(n, dtype=np.float64)  # waiting + external seconds
        self._batch = np.zeros(n, dtype=np.int64)
        self._context = np.zeros(n, dtype=np.int64)
        self._running: dict[int, _Running] = {}
        self._matrices: tuple[IntArray, FloatArray, FloatArray, FloatArray] | None = None
        self._view: tuple[tuple[str, ...], dict[str, int] | None, IntArray | None] = ((), {}, None)
        self._last: LoadArrays | None = None  # the last read, while it cannot change
        self._dirty = ChangeSet(self.states)  # instances add themselves when they change
        self._lock = threading.Lock()
        for state in self._rows:
            state.watch(self._dirty)

    def serves(self, states: Sequence[InstanceState]) -> bool:
        """Whether ``states`` are this table's instances (the same objects, in order)."""
        if states is self.states:  # a caller that passes the same tuple every time
            return True
        if len(states) != len(self.states):
            return False
        return (states if isinstance(states, tuple) else tuple(states)) == self.states

    def read(self, now: float | None) -> LoadArrays:
        """The healthy instances' load at ``now`` (see :meth:`InstanceState.snapshot`)."""
        with self._lock:
            if self._dirty:
                self._refresh()
                self._last = None
            elif self._last is not None:  # nothing changed and nothing depends on ``now``
                return self._last
            running = self._running
            seconds = self._queued_seconds(now) if running else self._static
            ids, positions, rows = self._view
            if rows is None:
                loads = LoadArrays(
                    ids, positions, self._queued_requests, seconds, self._batch, self._context
                )
            else:
                loads = LoadArrays(
                    ids, positions, self._queued_requests[rows], seconds[rows], self._batch[rows],
                    self._context[rows],
                )  # fmt: skip
            if not running:
                self._last = loads
            return loads

    # --- internals (under the lock) -------------------------------------------------------------
    def _refresh(self) -> None:
        # copy on write: arrays handed out by earlier reads are never mutated
        health_moved = not self._view[0]
        dirty, healthy, rows_of = self._dirty, self._healthy, self._rows
        if self._prefill:
            queued = self._queued_requests = self._queued_requests.copy()
            static = self._static = self._static.copy()
            self._matrices = None
            running_rows = self._running
            while dirty:
                try:
                    state = dirty.pop()  # a mutation may add more meanwhile: read until none left
                except KeyError:
                    break
                ok, requests, waiting_s, running, external_s, _, _ = state.load_terms()
                for row in rows_of[state]:
                    if healthy[row] is not ok:
                        healthy[row] = ok
                        health_moved = True
                    queued[row] = requests
                    static[row] = waiting_s + external_s
                    if running:
                        running_rows[row] = (waiting_s, running, external_s)
                    else:
                        running_rows.pop(row, None)
        else:
            batch = self._batch = self._batch.copy()
            context = self._context = self._context.copy()
            while dirty:
                try:
                    state = dirty.pop()
                except KeyError:
                    break
                ok, _, _, _, _, batch_size, context_tokens = state.load_terms()
                for row in rows_of[state]:
                    if healthy[row] is not ok:
                        healthy[row] = ok
                        health_moved = True
                    batch[row] = batch_size
                    context[row] = context_tokens
        if health_moved:
            rows = np.flatnonzero(healthy)
            if len(rows) == len(self.states):
                self._view = (self._ids, positions_of(self._ids), None)
            else:
                ids = tuple(self._ids[r] for r in rows.tolist())
                self._view = (ids, positions_of(ids), rows)

    def _queued_seconds(self, now: float | None) -> FloatArray:
        """Seconds per row at ``now`` when some rows have running requests."""
        if len(self._running) >= MANY_RUNNING:
            return self._queued_seconds_numpy(now)
        return running_seconds(self._static, self._running, now)

    def _queued_seconds_numpy(self, now: float | None) -> FloatArray:
        if self._matrices is None:
            self._matrices = self._pad_running()
        rows, predicted, started, external = self._matrices
        # column 0: waiting (started -inf, so its remainder comes out 0.0; read from predicted)
        remaining = predicted if now is None else np.maximum(0.0, predicted - (now - started))
        total = predicted[:, 0] + remaining[:, 1]
        for k in range(2, predicted.shape[1]):  # left to right, as the snapshot sums
            total += remaining[:, k]
        total += external
        seconds = self._static.copy()
        seconds[rows] = total
        return seconds

    def _pad_running(self) -> tuple[IntArray, FloatArray, FloatArray, FloatArray]:
        rows = sorted(self._running)
        width = 1 + max(len(self._running[r][1]) for r in rows)
        # padding (0.0, -inf): max(0.0, 0.0 - (now + inf)) = 0.0, and 0.0 without ``now``
        predicted = np.zeros((len(rows), width), dtype=np.float64)
        started = np.full((len(rows), width), -np.inf, dtype=np.float64)
        external = np.zeros(len(rows), dtype=np.float64)
        for at, row in enumerate(rows):
            waiting, running, external[at] = self._running[row]
            predicted[at, 0] = waiting
            for k, (p, s) in enumerate(running, start=1):
                predicted[at, k] = p
                started[at, k] = s
        return np.array(rows, dtype=np.int64), predicted, started, external


def running_seconds(
    static: FloatArray, running: dict[int, _Running], now: float | None
) -> FloatArray:
    """A copy of ``static`` with each row of ``running`` (row -> its waiting seconds, running
    ``(predicted, started)`` entries in start order, external seconds) replaced by its queued
    seconds at ``now``: :meth:`InstanceState.snapshot`'s sum, term for term."""
    seconds = static.copy()
    for row, (total, entries, external) in running.items():
        if now is None:
            for predicted, _ in entries:
                total += predicted
        else:  # max(0.0, left) without a call
            for predicted, started in entries:
                left = predicted - (now - started)
                total += left if left > 0.0 else 0.0
        seconds[row] = total + external
    return seconds


def positions_of(ids: tuple[str, ...]) -> dict[str, int] | None:
    """Instance id -> position; None when an id repeats."""
    positions = {instance_id: at for at, instance_id in enumerate(ids)}
    return positions if len(positions) == len(ids) else None
