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

import numpy as np
import numpy.typing as npt

from kvflow.router.candidates import DecodeTable, PrefillTable
from kvflow.router.estimators import DecodeTimeModel, PrefillTimeModel, TransferEstimator
from kvflow.router.load_table import LoadArrays
from kvflow.router.types import RouteRequest

IntArray = npt.NDArray[np.int64]

# (t_local, balanced prefix blocks, balanced pull blocks, balanced t_transfer, balanced t_prefill)
_Option = tuple[float, int, int, float, float]


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

    def score(self, req: RouteRequest, load: LoadArrays, local_lens: IntArray) -> PrefillTable:
        """``local_lens[i]``: leading blocks of ``req`` held by ``load.instance_ids[i]``."""
        n = len(load.instance_ids)
        best = int(local_lens.max()) if n else 0
        holders = local_lens.nonzero()[0]
        options: dict[int, _Option] = {}
        t_best: list[float] = []  # the best match's prefill seconds, computed at most once

        def option(local_len: int) -> _Option:
            t_local = self._predict(req, local_len)
            if best > self._threshold * local_len:
                if not t_best:
                    t_best.append(self._predict(req, best))
                pull = best - local_len
                t_transfer = self._transfer.estimate(pull * self._block_nbytes)
                if t_transfer + t_best[0] < t_local:
                    return (t_local, best, pull, t_transfer, t_best[0])
            return (t_local, local_len, 0, 0.0, t_local)

        columns = np.empty((n, 5), dtype=np.float64)
        if len(holders) < n:
            columns[:] = options.setdefault(0, option(0))
        if len(holders):
            held = local_lens[holders].tolist()
            for length in held:
                if length not in options:
                    options[length] = option(length)
            columns[holders] = [options[length] for length in held]
        t_queue = load.queued_seconds
        t_local = columns[:, 0]
        balanced_transfer = columns[:, 3]
        balanced_prefill = columns[:, 4]
        local_ttft = (0.0 + t_queue) + t_local
        if len(options) == 1 and next(iter(options.values()))[2] == 0:
            balanced_ttft = local_ttft  # nobody pulls: the balanced options are the local ones
        else:
            balanced_ttft = (balanced_transfer + t_queue) + balanced_prefill
        return PrefillTable(
            instance_ids=load.instance_ids,
            local_prefix_blocks=local_lens,
            queued_requests=load.queued_requests,
            t_queue=t_queue,
            local_t_prefill=t_local,
            local_ttft=local_ttft,
            balanced_prefix_blocks=columns[:, 1].astype(np.int64),
            balanced_pull_blocks=columns[:, 2].astype(np.int64),
            balanced_t_transfer=balanced_transfer,
            balanced_t_prefill=balanced_prefill,
            balanced_ttft=balanced_ttft,
        )

    def _predict(self, req: RouteRequest, blocks: int) -> float:
        reused = min(blocks * self._block_size, req.prompt_len)
        return self._model.predict(req.prompt_len, reused)


def score_decode(req: RouteRequest, load: LoadArrays, model: DecodeTimeModel) -> DecodeTable:
    """Step 4's predictions: each instance's TBT with ``req`` joined to its batch."""
    batch = load.decode_batch_size + 1
    context = load.decode_context_tokens + req.prompt_len
    return DecodeTable(load.instance_ids, batch, context, model.predict_many(batch, context))
