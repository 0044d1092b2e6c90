"""A request's predictions for every healthy instance at once: what policies read.

The conductor scores all instances together (:mod:`.scoring`) into a :class:`PrefillTable` and a
:class:`DecodeTable`, struct-of-arrays records: position ``i`` is the ``i``-th healthy instance
in the caller's order. The per-instance records of :mod:`.types` (:class:`PrefillCandidate`,
:class:`DecodeCandidate`) are built only when someone reads ``RouteDecision.candidates``
(:class:`LazyRecords`): building 64 of them per decision cost more than the decision itself.

Arrays are never mutated after construction; readers must not mutate them either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import numpy as np
import numpy.typing as npt

from kvflow.router.types import DecodeCandidate, Estimate, PrefillCandidate

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class PrefillTable:
    """Predictions for the healthy prefill instances (see :class:`PrefillCandidate` for the
    meaning of each column). ``*_ttft = (t_transfer + t_queue) + t_prefill``, as
    :attr:`Estimate.ttft` computes it; the local option never transfers."""

    instance_ids: tuple[str, ...]
    local_prefix_blocks: IntArray
    queued_requests: IntArray
    t_queue: FloatArray
    local_t_prefill: FloatArray
    local_ttft: FloatArray
    balanced_prefix_blocks: IntArray
    balanced_pull_blocks: IntArray
    balanced_t_transfer: FloatArray
    balanced_t_prefill: FloatArray
    balanced_ttft: FloatArray

    def __len__(self) -> int:
        return len(self.instance_ids)

    def local(self, i: int) -> Estimate:
        return Estimate(
            int(self.local_prefix_blocks[i]), 0, 0.0, float(self.t_queue[i]),
            float(self.local_t_prefill[i]),
        )  # fmt: skip

    def balanced(self, i: int) -> Estimate:
        return Estimate(
            int(self.balanced_prefix_blocks[i]), int(self.balanced_pull_blocks[i]),
            float(self.balanced_t_transfer[i]), float(self.t_queue[i]),
            float(self.balanced_t_prefill[i]),
        )  # fmt: skip

    def records(self) -> tuple[PrefillCandidate, ...]:
        """Every row as a :class:`PrefillCandidate` (Python ints and floats)."""
        columns = zip(
            self.instance_ids,
            self.local_prefix_blocks.tolist(),
            self.queued_requests.tolist(),
            self.t_queue.tolist(),
            self.local_t_prefill.tolist(),
            self.balanced_prefix_blocks.tolist(),
            self.balanced_pull_blocks.tolist(),
            self.balanced_t_transfer.tolist(),
            self.balanced_t_prefill.tolist(),
            strict=True,
        )
        out = []
        for iid, local_len, queued, t_queue, t_local, prefix, pull, t_tr, t_pre in columns:
            local = Estimate(local_len, 0, 0.0, t_queue, t_local)
            balanced = local if pull == 0 else Estimate(prefix, pull, t_tr, t_queue, t_pre)
            out.append(PrefillCandidate(iid, local_len, queued, local, balanced))
        return tuple(out)


@dataclass(frozen=True, eq=False)
class DecodeTable:
    """Predicted TBT of each healthy decode instance if the request joined its batch:
    ``batch_size`` and ``context_tokens`` already include the request."""

    instance_ids: tuple[str, ...]
    batch_size: IntArray
    context_tokens: IntArray
    tbt_s: FloatArray

    def __len__(self) -> int:
        return len(self.instance_ids)

    def records(self) -> tuple[DecodeCandidate, ...]:
        return tuple(
            DecodeCandidate(*row)
            for row in zip(
                self.instance_ids,
                self.batch_size.tolist(),
                self.context_tokens.tolist(),
                self.tbt_s.tolist(),
                strict=True,
            )
        )


class LazyRecords(Sequence[T]):
    """An immutable sequence built on first use by ``build`` (once; then cached). Compares equal
    to any sequence with the same items (a tuple included), hashes like the tuple. Thread-safe:
    a race builds the same tuple twice."""

    __slots__ = ("_build", "_items")

    def __init__(self, build: Callable[[], tuple[T, ...]]) -> None:
        self._build: Callable[[], tuple[T, ...]] | None = build
        self._items: tuple[T, ...] | None = None

    def _all(self) -> tuple[T, ...]:
        items = self._items
        if items is None:
            build = self._build
            assert build is not None
            items = self._items = build()
            self._build = None
        return items

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...
    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __iter__(self) -> Iterator[T]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyRecords):
            return self._all() == other._all()
        if isinstance(other, tuple | list):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (self._all(),))  # pickles as the plain tuple
