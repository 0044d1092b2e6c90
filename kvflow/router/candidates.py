"""A request's predictions for every healthy instance at once: what policies read.

The conductor scores all instances together (:mod:`.scoring`) into a :class:`PrefillTable` and a
:class:`DecodeTable`, struct-of-arrays records: position ``i`` is the ``i``-th healthy instance
in the caller's order. The per-instance records of :mod:`.types` (:class:`PrefillCandidate`,
:class:`DecodeCandidate`) are built only when someone reads ``RouteDecision.candidates``
(:class:`LazyRecords`): building 64 of them per decision cost more than the decision itself.

Arrays are never mutated after construction; readers must not mutate them either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar, overload

import numpy as np
import numpy.typing as npt

from kvflow.router.estimators import DecodeTimeModel
from kvflow.router.types import DecodeCandidate, Estimate, PrefillCandidate

FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.int64]
T = TypeVar("T")
_tuple_new = tuple.__new__


def argmin_array(values: FloatArray, tie_break: int = 0) -> int:
    """:func:`~kvflow.router.policies.base.argmin` over a non-empty array without NaN (the same
    index): the lowest value; exact ties go to the ``tie_break mod ties``-th tied index."""
    first = int(values.argmin())  # C-level (``values.min()`` goes through a Python wrapper)
    tied = (values == values[first]).nonzero()[0]
    return first if len(tied) == 1 else int(tied[tie_break % len(tied)])


# One way to prefill the request on an instance with a given local prefix (in blocks):
# (t_local, balanced prefix blocks, balanced pull blocks, balanced t_transfer, balanced t_prefill)
Option = tuple[float, int, int, float, float]


@dataclass(frozen=True, eq=False)
class PrefillTable:
    """Predictions for the healthy prefill instances (see :class:`PrefillCandidate` for what
    each prediction means).

    Predictions depend on an instance only through its local prefix length and its queue, so
    the table keeps ``options`` (local prefix blocks -> :data:`Option`, with an entry for 0 when
    some instance holds nothing) and ``held`` (position -> local prefix blocks, for the
    instances holding any) beside the two arrays policies compare:
    ``*_ttft = (t_transfer + t_queue) + t_prefill``, as :attr:`Estimate.ttft` computes it.
    """

    instance_ids: tuple[str, ...]
    queued_requests: IntArray
    t_queue: FloatArray
    local_ttft: FloatArray
    balanced_ttft: FloatArray
    held: dict[int, int]
    options: dict[int, Option]

    def __len__(self) -> int:
        return len(self.instance_ids)

    def local_blocks(self, i: int) -> int:
        return self.held.get(i, 0)

    # Estimate(...) through tuple.__new__: the same named tuple without its __new__ frame
    def local(self, i: int) -> Estimate:
        local_len = self.held.get(i, 0)
        t_queue = float(self.t_queue[i])
        return _tuple_new(Estimate, (local_len, 0, 0.0, t_queue, self.options[local_len][0]))

    def balanced(self, i: int) -> Estimate:
        local_len = self.held.get(i, 0)
        t_local, prefix, pull, t_transfer, t_prefill = self.options[local_len]
        if not pull:
            return _tuple_new(Estimate, (local_len, 0, 0.0, float(self.t_queue[i]), t_local))
        return _tuple_new(Estimate, (prefix, pull, t_transfer, float(self.t_queue[i]), t_prefill))

    def pulls(self, i: int) -> bool:
        """Whether instance ``i``'s balanced option pulls blocks."""
        return self.options[self.held.get(i, 0)][2] > 0

    def first_holder(self, blocks: int) -> int:
        """The first position whose local prefix is at least ``blocks`` (> 0) long."""
        return min(at for at, length in self.held.items() if length >= blocks)

    def records(self) -> tuple[PrefillCandidate, ...]:
        """Every row as a :class:`PrefillCandidate` (Python ints and floats)."""
        out = []
        columns = zip(
            self.instance_ids, self.queued_requests.tolist(), self.t_queue.tolist(), strict=True
        )
        for at, (iid, queued, t_queue) in enumerate(columns):
            local_len = self.held.get(at, 0)
            t_local, prefix, pull, t_transfer, t_prefill = self.options[local_len]
            local = Estimate(local_len, 0, 0.0, t_queue, t_local)
            balanced = Estimate(prefix, pull, t_transfer, t_queue, t_prefill) if pull else local
            out.append(PrefillCandidate(iid, local_len, queued, local, balanced))
        return tuple(out)


@dataclass(frozen=True, eq=False)
class DecodeTable:
    """Predicted TBT of each healthy decode instance if the request joined its batch:
    ``loaded_batch_size`` is the batch without it, ``context_tokens`` includes its prompt."""

    instance_ids: tuple[str, ...]
    loaded_batch_size: IntArray
    context_tokens: IntArray
    tbt_s: FloatArray

    def __len__(self) -> int:
        return len(self.instance_ids)

    def best(self, tie_break: int = 0) -> tuple[int, float]:
        """The position with the lowest TBT (exact ties: the ``tie_break mod ties``-th, as
        :func:`~kvflow.router.policies.base.argmin` picks) and that TBT."""
        best = argmin_array(self.tbt_s, tie_break)
        return best, float(self.tbt_s[best])

    def records(self) -> tuple[DecodeCandidate, ...]:
        return tuple(
            DecodeCandidate(*row)
            for row in zip(
                self.instance_ids,
                (self.loaded_batch_size + 1).tolist(),
                self.context_tokens.tolist(),
                self.tbt_s.tolist(),
                strict=True,
            )
        )


DecodeGroups = Mapping[tuple[int, int], Sequence[int]]
"""A decode group's instances by load: each distinct ``(batch size, context tokens)`` pair ->
the positions with it, ascending (every position once)."""


@dataclass(frozen=True, eq=False)
class GroupedDecodeTable:
    """A :class:`DecodeTable` whose choice was made over :data:`DecodeGroups` (one prediction
    per distinct load, not one per instance: an idle group has one load for most instances):
    ``lowest_tbt`` and the ``tied`` positions that reach it, ascending. The arrays are only
    computed for :meth:`records`, from the loads' own (never mutated) arrays."""

    instance_ids: tuple[str, ...]
    loaded_batch_size: IntArray
    loaded_context_tokens: IntArray
    prompt_len: int
    model: DecodeTimeModel
    lowest_tbt: float
    tied: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.instance_ids)

    def best(self, tie_break: int = 0) -> tuple[int, float]:
        """As :meth:`DecodeTable.best`: the same position and TBT."""
        tied = self.tied
        return (tied[0] if len(tied) == 1 else tied[tie_break % len(tied)]), self.lowest_tbt

    def records(self) -> tuple[DecodeCandidate, ...]:
        context = self.loaded_context_tokens + self.prompt_len
        tbt = self.model.predict_many(self.loaded_batch_size + 1, context)
        return DecodeTable(self.instance_ids, self.loaded_batch_size, context, tbt).records()


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
