"""Batches: the per-request progress records that backends update and callers poll.

A backend reports on a request only through its :class:`RequestProgress`: ``start`` when bytes
begin to move, ``add_bytes`` as slices land, ``fail`` for an error, and ``settle_slice`` once per
slice. The request becomes terminal when its last slice settles, so once a status is terminal no
backend touches the request's local range again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvflow.transfer.errors import BatchCapacityError, BatchNotFoundError, BatchPendingError
from kvflow.transfer.types import BatchId, TransferState, TransferStatus


class RequestProgress:
    """Mutable progress of one request. Thread-safe (shares its batch's condition lock)."""

    __slots__ = (
        "_batch",
        "_error",
        "_error_state",
        "_outstanding",
        "_state",
        "deadline",
        "length",
        "transferred",
    )

    def __init__(self, batch: Batch, length: int, deadline: float) -> None:
        self._batch = batch
        self.length = length
        self.deadline = deadline
        self.transferred = 0
        self._state = TransferState.WAITING
        self._outstanding = 0
        self._error: str | None = None
        self._error_state = TransferState.FAILED

    def expect_slices(self, count: int) -> None:
        """Declare how many slices will settle (called once, before any is started)."""
        with self._batch.cond:
            self._outstanding += count

    def start(self) -> None:
        with self._batch.cond:
            if self._state is TransferState.WAITING:
                self._state = TransferState.PENDING

    def add_bytes(self, nbytes: int) -> None:
        with self._batch.cond:
            self.transferred += nbytes

    def fail(self, error: BaseException | str, *, timeout: bool = False) -> None:
        """Record an error (the first one wins); the request ends FAILED, or TIMEOUT."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._batch.cond:
            if self._error is None:
                self._error = text
                self._error_state = TransferState.TIMEOUT if timeout else TransferState.FAILED

    @property
    def failed(self) -> bool:
        with self._batch.cond:
            return self._error is not None

    def settle_slice(self) -> None:
        """One slice finished (moved, or given up); the last one makes the request terminal."""
        with self._batch.cond:
            self._outstanding -= 1
            assert self._outstanding >= 0, "more slices settled than declared"
            if self._outstanding == 0:
                if self._error is not None:
                    self._state = self._error_state
                elif self.transferred == self.length:
                    self._state = TransferState.COMPLETED
                else:  # pragma: no cover - a backend bug, reported rather than hidden
                    self._error = f"ProtocolError: moved {self.transferred} of {self.length} bytes"
                    self._state = TransferState.FAILED
                self._batch.settled_one()

    def status(self) -> TransferStatus:
        with self._batch.cond:
            error = self._error if self._state.terminal else None
            return TransferStatus(self._state, self.transferred, error)


class Batch:
    """Up to ``capacity`` requests submitted (possibly over several submit calls) as one unit."""

    def __init__(self, batch_id: BatchId, capacity: int, clock: Callable[[], float]) -> None:
        self.batch_id = batch_id
        self.capacity = capacity
        self.cond = threading.Condition()
        self._clock = clock
        self._entries: list[RequestProgress] = []
        self._open = 0  # entries not terminal yet: a waiter wakes once, when it reaches 0

    def reserve(self, lengths: list[int], timeout_s: float) -> list[RequestProgress]:
        """Append one progress record per length; BatchCapacityError if they do not fit."""
        with self.cond:
            if len(self._entries) + len(lengths) > self.capacity:
                raise BatchCapacityError(
                    f"batch {self.batch_id} has capacity {self.capacity}: holds "
                    f"{len(self._entries)}, cannot add {len(lengths)}"
                )
            deadline = self._clock() + timeout_s
            added = [RequestProgress(self, length, deadline) for length in lengths]
            self._entries.extend(added)
            self._open += len(added)
            return added

    def settled_one(self) -> None:
        """An entry became terminal (``cond`` held)."""
        self._open -= 1
        if self._open == 0:
            self.cond.notify_all()

    def statuses(self) -> list[TransferStatus]:
        with self.cond:
            return [entry.status() for entry in self._entries]

    def pending(self) -> bool:
        with self.cond:
            return self._open > 0

    def wait(self, timeout: float | None) -> bool:
        """Block until every request is terminal; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self._open > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.cond.wait(remaining)
            return True


class BatchTable:
    """Allocated batches by id. Thread-safe; ids are never reused within one engine."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._batches: dict[int, Batch] = {}
        self._next_id = 1
        self._clock = clock

    def allocate(self, capacity: int) -> Batch:
        with self._lock:
            batch = Batch(BatchId(self._next_id), capacity, self._clock)
            self._next_id += 1
            self._batches[batch.batch_id] = batch
            return batch

    def get(self, batch_id: BatchId) -> Batch:
        with self._lock:
            batch = self._batches.get(batch_id)
        if batch is None:
            raise BatchNotFoundError(f"batch {batch_id} is not allocated (never, or freed)")
        return batch

    def free(self, batch_id: BatchId) -> None:
        """Drop a batch; BatchPendingError (batch kept) while any of its requests is running."""
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is None:
                raise BatchNotFoundError(f"batch {batch_id} is not allocated (never, or freed)")
            if batch.pending():
                raise BatchPendingError(f"batch {batch_id} still has transfers in flight")
            del self._batches[batch_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._batches)
