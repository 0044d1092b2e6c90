"""Scoring every healthy instance for one request at once (Algorithm 1, steps 2 and 4).

Pure functions from the request, the instances' load arrays and the prefix match lengths to a
:class:`PrefillTable` / :class:`DecodeTable`. A prefill prediction depends on the instance only
through its local prefix length, and a request meets few distinct lengths (most instances hold
nothing), so the prefill model and the transfer estimator run once per distinct length, in
Python, with the same expressions as the per-instance reference
(:mod:`kvflow.router.reference`); the per-instance work is a handful of array operations. The
results are bit-identical to the reference's.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from kvflow.router.candidates import (
    DecodeTable,
    FloatArray,
    GroupedDecodeTable,
    IntArray,
    Option,
    PrefillTable,
)
from kvflow.router.estimators import DecodeTimeModel, PrefillTimeModel, TransferEstimator
from kvflow.router.load_table import LoadArrays
from kvflow.router.types import RouteRequest

_new = object.__new__


class PrefillScorer:
    """Step 2 for one request: the local and the balanced option of every instance.

    Immutable settings; :meth:`score` is pure and thread-safe when ``transfer`` is.
    """

    def __init__(
        self,
        model: PrefillTimeModel,
        transfer: TransferEstimator,
        block_size: int,
        block_nbytes: int,
        balancing_threshold: float,
    ) -> None:
        self._model = model
        self._transfer = transfer
        self._block_size = block_size
        self._block_nbytes = block_nbytes
        self._threshold = balancing_threshold

    def score(self, req: RouteRequest, load: LoadArrays, held: dict[int, int]) -> PrefillTable:
        """``held``: position in ``load`` -> local prefix blocks of ``req``, for the instances
        holding any (the others hold none)."""
        n = len(load.instance_ids)
        t_queue = load.queued_seconds
        if not held and n:  # nobody holds a prefix (most requests): one option, one array sum
            t_local = self._model.predict(req.prompt_len, 0)  # _predict(req, 0), inline
            local_ttft = t_queue + t_local
            table = _new(PrefillTable)  # as below
            table.__dict__.update(
                instance_ids=load.instance_ids, queued_requests=load.queued_requests,
                t_queue=t_queue, local_ttft=local_ttft, balanced_ttft=local_ttft, held=held,
                options={0: (t_local, 0, 0, 0.0, t_local)},
            )  # fmt: skip
            return table
        options = self._options(req, held, with_zero=len(held) < n)
        # ``t_transfer + t_queue`` with t_transfer = 0.0 is t_queue itself (t_queue >= +0.0)
        if 0 in options:
            t_local, _, pull, t_transfer, t_prefill = options[0]
            local_ttft = t_queue + t_local
            if pull:
                balanced_ttft = (t_transfer + t_queue) + t_prefill
            else:
                balanced_ttft = local_ttft.copy() if held else local_ttft
        else:
            local_ttft = np.empty(n, dtype=np.float64)
            balanced_ttft = np.empty(n, dtype=np.float64)
        for at, local_len in held.items():
            t_local, _, pull, t_transfer, t_prefill = options[local_len]
            queued = float(t_queue[at])
            local_ttft[at] = queued + t_local
            balanced_ttft[at] = (t_transfer + queued) + t_prefill if pull else queued + t_local
        # the frozen dataclass's fields in one dict update, not one object.__setattr__ each in
        # its generated __init__: the same instance, cheaper
        table = _new(PrefillTable)
        table.__dict__.update(
            instance_ids=load.instance_ids, queued_requests=load.queued_requests,
            t_queue=t_queue, local_ttft=local_ttft, balanced_ttft=balanced_ttft, held=held,
            options=options,
        )  # fmt: skip
        return table

    def _options(
        self, req: RouteRequest, held: dict[int, int], with_zero: bool
    ) -> dict[int, Option]:
        """The option of every local prefix length present (Algorithm 1, lines 5-8)."""
        best = max(held.values(), default=0)
        options: dict[int, Option] = {}
        t_best: list[float] = []  # the best match's prefill seconds, computed at most once
        lengths = set(held.values())
        if with_zero:
            lengths.add(0)
        for local_len in sorted(lengths):
            t_local = self._predict(req, local_len)
            options[local_len] = (t_local, local_len, 0, 0.0, t_local)
            if best > self._threshold * local_len:
                if not t_best:
                    t_best.append(self._predict(req, best))
                pull = best - local_len
                t_transfer = self._transfer.estimate(pull * self._block_nbytes)
                if t_transfer + t_best[0] < t_local:
                    options[local_len] = (t_local, best, pull, t_transfer, t_best[0])
        return options

    def _predict(self, req: RouteRequest, blocks: int) -> float:
        reused = min(blocks * self._block_size, req.prompt_len)
        return self._model.predict(req.prompt_len, reused)


class DecodeScorer:
    """Step 4's predictions: each decode instance's TBT with the request joined to its batch.

    Keeps the batch-size part of the model for the last batch-size array it saw: a
    :class:`LoadTable` hands out a new array whenever a batch changes (and never mutates one),
    so the array's identity says whether the part is still valid. Thread-safe (the cache is one
    tuple, replaced whole).
    """

    def __init__(self, model: DecodeTimeModel) -> None:
        self._model = model
        self._cache: tuple[IntArray, FloatArray] | None = None

    def score(self, req: RouteRequest, load: LoadArrays) -> DecodeTable | GroupedDecodeTable:
        """Every instance's TBT as arrays, or, when ``load`` has its groups, a table that
        predicts once per group (:class:`GroupedDecodeTable`: the same choice and values)."""
        groups = load.decode_groups
        if groups is not None:  # one prediction per distinct load
            lowest, tied = self._model.lowest_joined(groups, req.prompt_len)
            table = _new(GroupedDecodeTable)  # as below
            table.__dict__.update(
                instance_ids=load.instance_ids,
                loaded_batch_size=load.decode_batch_size,
                loaded_context_tokens=load.decode_context_tokens,
                prompt_len=req.prompt_len,
                model=self._model,
                lowest_tbt=lowest,
                # a copy: the owner changes its groups in place after this call
                tied=tuple(tied[0]) if len(tied) == 1 else tuple(sorted(chain.from_iterable(tied))),
            )
            return table
        batch = load.decode_batch_size
        cache = self._cache
        if cache is None or cache[0] is not batch:
            cache = self._cache = (batch, self._model.batch_terms(batch + 1))
        context = load.decode_context_tokens + req.prompt_len
        tbt = self._model.predict_from_batch_terms(cache[1], context)
        arrays = _new(DecodeTable)  # as PrefillScorer.score builds its table
        arrays.__dict__.update(
            instance_ids=load.instance_ids,
            loaded_batch_size=batch,
            context_tokens=context,
            tbt_s=tbt,
        )
        return arrays
