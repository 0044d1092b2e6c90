"""StagingArea: page-sized slots allocated once, leased per request, and the LeaseBook that
hands a decode node's leases out across RPCs and frees the ones nobody took in time."""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.stages.engine.pages import lazy_zeros
from kvflow.stages.errors import NoCapacity
from kvflow.transfer import SegmentHandle, TransferEngine

logger = logging.getLogger(__name__)

# A decode node's staging area is registered under this segment name.
STAGING_SEGMENT = "staging"


def staging_segment_name(instance_id: str) -> str:
    return f"{instance_id}/staging"


@dataclass(frozen=True)
class StagingLease:
    """Slots of a StagingArea held by one request, in block order."""

    slots: tuple[int, ...]


class StagingArea:
    """Page-sized slots, allocated once: on a decode instance the streamed KV lands here; on a
    prefill instance reuse-load reads cached blocks here (no fresh allocation per request).

    One torch tensor ``[num_slots, *page_shape]``, registered with the transfer engine (when one
    is given) as segment ``<instance>/staging``. ``lease``/``release`` are thread-safe; a lease
    is released once the engine has imported the pages (or by cleanup on failure).
    """

    def __init__(
        self,
        instance_id: str,
        num_slots: int,
        page_shape: tuple[int, ...],
        dtype: torch.dtype,
        transfer: TransferEngine | None = None,
        name: str | None = None,
        resident: int = 0,
    ) -> None:
        self.instance_id = instance_id
        # the first `resident` slots are mapped now; leases take them first (LIFO free list)
        self.tensor = lazy_zeros((num_slots, *page_shape), dtype, torch.device("cpu"), resident)
        self.page_nbytes = int(self.tensor[0].numel() * self.tensor.element_size())
        self.segment_name = name or staging_segment_name(instance_id)
        self.segment: SegmentHandle | None = None
        if transfer is not None:
            transfer.register_memory(self.segment_name, self.tensor.view(torch.uint8).numpy())
            self.segment = transfer.open_segment("local", self.segment_name)
        self._free: deque[int] = deque(range(num_slots))
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lease(self, n: int) -> StagingLease:
        """Take ``n`` slots; NoCapacity (taking none) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                raise NoCapacity(
                    f"decode instance {self.instance_id}: {n} staging pages needed, "
                    f"{len(self._free)} free"
                )
            return StagingLease(tuple(self._free.popleft() for _ in range(n)))

    def release(self, lease: StagingLease) -> None:
        with self._lock:
            # to the front: the next lease reuses slots already resident (lazily mapped pool)
            self._free.extendleft(reversed(lease.slots))

    def offset(self, slot: int) -> int:
        return slot * self.page_nbytes

    def pages(self, lease: StagingLease, n: int) -> list[Any]:
        """Views of the first ``n`` leased slots, in block order (valid until release)."""
        return [self.tensor[s] for s in lease.slots[:n]]


class LeaseBook:
    """Leases of one StagingArea held between RPCs (a decode node: Reserve, then Decode or
    Release), each with a deadline: ``timeout_s``, or longer when the caller asks
    (``hold_s``: its request's time left, while its Prefill queues on a loaded node), up to
    MAX_HOLD_S. Thread-safe."""

    MAX_HOLD_S = 600.0  # a lease whose router died is freed after this at the latest

    def __init__(self, staging: StagingArea, timeout_s: float) -> None:
        self.staging = staging
        self._timeout_s = timeout_s
        self._leases: dict[str, tuple[StagingLease, float]] = {}
        self._lock = threading.Lock()

    def hold_s(self, asked: float) -> float:
        """How long a lease asked for ``asked`` seconds (0: the default) is held."""
        if not math.isfinite(asked) or asked <= self._timeout_s:
            return self._timeout_s
        return min(asked, max(self.MAX_HOLD_S, self._timeout_s))

    def lease(self, request_id: str, n: int, hold_s: float = 0.0) -> tuple[str, StagingLease]:
        """Take ``n`` slots under a new lease id; NoCapacity when fewer are free."""
        lease = self.staging.lease(n)
        lease_id = f"{request_id}:{uuid.uuid4().hex[:8]}"
        with self._lock:
            self._leases[lease_id] = (lease, time.monotonic() + self.hold_s(hold_s))
        return lease_id, lease

    def take(self, lease_id: str) -> StagingLease | None:
        """The lease, now owned by the caller (who releases it); None if unknown/expired."""
        with self._lock:
            entry = self._leases.pop(lease_id, None)
        return None if entry is None else entry[0]

    def release(self, lease_id: str) -> bool:
        lease = self.take(lease_id)
        if lease is not None:
            self.staging.release(lease)
        return lease is not None

    def reap(self, now: float | None = None) -> int:
        """Free the leases past their deadline; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [k for k, (_, deadline) in self._leases.items() if deadline < now]
            dropped = [self._leases.pop(k)[0] for k in expired]
        for lease in dropped:
            self.staging.release(lease)
        if dropped:
            logger.info("released %d expired staging leases", len(dropped))
        return len(dropped)

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
