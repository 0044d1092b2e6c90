"""The simulator's own load accounting: the arrays the conductor reads, kept up to date where
the simulated instances change.

A server books its instances in :class:`~kvflow.router.instances.InstanceState` objects that a
:class:`~kvflow.router.load_table.LoadTable` watches and re-reads. The simulator is the only
writer of its instances' load and knows each change as it makes it, so :class:`SimLoads` updates
the arrays in place of both (issue 14's "incremental queue and batch accounting"): no change
notification, no ``load_terms`` tuple, no re-read per changed instance. The conductor takes them
through :meth:`Conductor.route_loads <kvflow.router.conductor.Conductor.route_loads>`.

Every value is bit-identical to what a ``LoadTable`` over ``InstanceState`` objects given the
same mutations would read: the waiting sum follows ``InstanceState`` (``+=`` on enqueue, the
``_unwait`` rule on start and finish), running requests are kept in start order, and a queue's
seconds at ``now`` are summed by the same function as the table's
(:func:`~kvflow.router.load_table.running_seconds`). The simulator's instances are always
healthy and have no external load (``0.0`` seconds, added as the table adds it).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence

import numpy as np

from kvflow.router.load_table import LoadArrays, positions_of, running_seconds

_tuple_new = tuple.__new__
_EXTERNAL_S = 0.0  # the simulator's instances report no load booked elsewhere


class SimLoads:
    """Load arrays of a group of prefill and a group of decode instances, by position.

    Mutators take the instance's position in its group; they raise ValueError or KeyError on a
    request booked twice or not booked (the simulator never does either). :meth:`prefill` and
    :meth:`decode` hand out :class:`LoadArrays` whose arrays are never mutated afterwards (copy
    on write), as ``LoadTable.read`` does; the decode read's ``decode_groups`` is the live
    structure, for the route call it is passed to only. Not thread-safe: one simulator run
    owns it.
    """

    def __init__(self, prefill_ids: Sequence[str], decode_ids: Sequence[str]) -> None:
        self._pids = tuple(prefill_ids)
        self._dids = tuple(decode_ids)
        n, m = len(self._pids), len(self._dids)
        self._ppos = positions_of(self._pids)
        self._dpos = positions_of(self._dids)
        # prefill: queued requests, waiting seconds, running entries in start order
        self._queued = np.zeros(n, dtype=np.int64)
        # the same counts as Python ints: a change is one element write into the array, not a
        # numpy scalar read, add and write (likewise _batch_n and _context_n)
        self._queued_n = [0] * n
        self._static = np.zeros(n, dtype=np.float64)  # waiting + external seconds
        self._waiting = [0] * n
        self._waiting_s = [0.0] * n
        self._queue: list[dict[str, float]] = [{} for _ in range(n)]  # not started: predicted
        self._started: list[dict[str, tuple[float, float]]] = [{} for _ in range(n)]
        self._running: dict[int, tuple[float, tuple[tuple[float, float], ...], float]] = {}
        # whether the arrays were handed out (copy before writing); the static seconds only are
        # when no request runs (else a read hands out a fresh sum instead)
        self._queued_shared = False
        self._static_shared = False
        self._prefill_last: LoadArrays | None = None  # the last read, while it cannot change
        # decode: batch size and context tokens
        self._batch = np.zeros(m, dtype=np.int64)
        self._context = np.zeros(m, dtype=np.int64)
        self._batch_n = [0] * m
        self._context_n = [0] * m
        self._decoding: list[dict[str, int]] = [{} for _ in range(m)]
        # the same loads as DecodeGroups: what the conductor's decode choice reads (one
        # prediction per distinct load, not a pass of array operations over every instance)
        self._groups: dict[tuple[int, int], list[int]] = {(0, 0): list(range(m))} if m else {}
        self._decode_shared = False
        self._decode_last: LoadArrays | None = None
        # the other group's columns (never written)
        self._pzeros = np.zeros(n, dtype=np.int64)
        self._dzeros_i = np.zeros(m, dtype=np.int64)
        self._dzeros_f = np.zeros(m, dtype=np.float64)

    # --- prefill queue ------------------------------------------------------------------------
    def enqueue(self, at: int, request_id: str, predicted_s: float) -> None:
        """``InstanceState.enqueue`` on prefill instance ``at``."""
        queue = self._queue[at]
        if request_id in queue or request_id in self._started[at]:
            raise ValueError(f"request_id {request_id!r} already queued on {self._pids[at]}")
        queue[request_id] = predicted_s
        self._waiting[at] += 1
        waiting_s = self._waiting_s[at] = self._waiting_s[at] + predicted_s
        self._prefill_row(at, waiting_s)
        queued = self._queued_n[at] = self._queued_n[at] + 1
        self._queued[at] = queued

    def start(self, at: int, request_id: str, now: float) -> None:
        """``InstanceState.start`` of a request not started yet (KeyError if not queued)."""
        predicted_s = self._queue[at].pop(request_id)
        waiting = self._waiting[at] = self._waiting[at] - 1
        # InstanceState._unwait, expression for expression (max(0.0, left) without the call)
        left = self._waiting_s[at] - predicted_s
        waiting_s = self._waiting_s[at] = (left if left > 0.0 else 0.0) if waiting else 0.0
        self._started[at][request_id] = (predicted_s, now)
        self._prefill_row(at, waiting_s)

    def finish(self, at: int, request_id: str) -> None:
        """``InstanceState.finish`` (KeyError if not queued)."""
        predicted_s = self._queue[at].pop(request_id, None)
        if predicted_s is None:
            del self._started[at][request_id]
            waiting_s = self._waiting_s[at]
        else:  # _unwait, as in start
            waiting = self._waiting[at] = self._waiting[at] - 1
            left = self._waiting_s[at] - predicted_s
            waiting_s = self._waiting_s[at] = (left if left > 0.0 else 0.0) if waiting else 0.0
        self._prefill_row(at, waiting_s)
        queued = self._queued_n[at] = self._queued_n[at] - 1
        self._queued[at] = queued

    def _prefill_row(self, at: int, waiting_s: float) -> None:
        """Row ``at``'s waiting and running terms (the caller then moves its queued count)."""
        if self._queued_shared:  # copy on write: arrays handed out are never mutated
            self._queued = self._queued.copy()
            self._queued_shared = False
        if self._static_shared:
            self._static = self._static.copy()
            self._static_shared = False
        self._prefill_last = None
        self._static[at] = waiting_s + _EXTERNAL_S
        started = self._started[at]
        if started:
            self._running[at] = (waiting_s, tuple(started.values()), _EXTERNAL_S)
        else:
            self._running.pop(at, None)

    def prefill(self, now: float | None) -> LoadArrays:
        """The prefill group's load at ``now`` (``LoadTable.read``'s values)."""
        last = self._prefill_last
        if last is not None:
            return last
        self._queued_shared = True
        running = self._running
        if running:
            seconds = running_seconds(self._static, running, now)  # a copy
        else:
            seconds = self._static
            self._static_shared = True
        loads = _tuple_new(  # LoadArrays(...) without the named tuple's __new__ frame
            LoadArrays,
            (self._pids, self._ppos, self._queued, seconds, self._pzeros, self._pzeros, None),
        )
        if not running:
            self._prefill_last = loads
        return loads

    # --- decode batch -------------------------------------------------------------------------
    def add_decode(self, at: int, request_id: str, context_tokens: int) -> None:
        """``InstanceState.add_decode`` on decode instance ``at``."""
        decoding = self._decoding[at]
        if request_id in decoding:
            raise ValueError(f"request_id {request_id!r} already decoding on {self._dids[at]}")
        decoding[request_id] = context_tokens
        self._decode_row(at, self._batch_n[at] + 1, self._context_n[at] + context_tokens)

    def remove_decode(self, at: int, request_id: str) -> None:
        """``InstanceState.remove_decode`` (KeyError if not decoding)."""
        context_tokens = self._decoding[at].pop(request_id)
        self._decode_row(at, self._batch_n[at] - 1, self._context_n[at] - context_tokens)

    def _decode_row(self, at: int, batch: int, context: int) -> None:
        """Row ``at``'s new batch size and context tokens, in the arrays and the groups."""
        if self._decode_shared:  # copy on write, as for prefill
            self._batch = self._batch.copy()
            self._context = self._context.copy()
            self._decode_shared = False
        self._decode_last = None
        groups = self._groups
        old = (self._batch_n[at], self._context_n[at])
        members = groups[old]
        if len(members) == 1:
            del groups[old]
        else:
            members.remove(at)
        new = (batch, context)
        joined = groups.get(new)
        if joined is None:
            groups[new] = [at]
        else:
            insort(joined, at)
        self._batch_n[at] = self._batch[at] = batch
        self._context_n[at] = self._context[at] = context

    def decode(self) -> LoadArrays:
        """The decode group's load (it does not depend on ``now``)."""
        last = self._decode_last
        if last is None:
            self._decode_shared = True
            last = self._decode_last = LoadArrays(
                self._dids, self._dpos, self._dzeros_i, self._dzeros_f, self._batch, self._context,
                self._groups,
            )  # fmt: skip
        return last
