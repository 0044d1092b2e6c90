"""One simulated prefill instance: chunked prefill, batched as the engine batches.

Each step packs, in FIFO order, chunks of the queued requests that are ready (their pulled
blocks have arrived) until ``batch_tokens`` new tokens are taken; one request contributes at
most ``chunk_tokens`` per step. A step costs the prefill model split over the chunks: with the
model's coefficients ``[c0, c1, c2, c3]`` over ``[1, m, m*(n+p), p]``, a step pays ``c0`` once,
a chunk of tokens ``[a, b)`` pays ``c1*(b-a) + c2*(b-a)*(b+a)`` and a request's first chunk also
``c3*p`` for loading its reused prefix. The chunks of one request add up to exactly
``predict(n, p)`` minus the fixed cost of the extra steps, so an unbatched, unchunked run equals
the model.

A request's blocks enter the prefix index when its prefill is complete (causal: nobody can hit
or pull a block before it is computed). Not thread-safe; owned by the simulator's loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvflow.router.estimators import PrefillTimeModel


@dataclass(slots=True)
class PrefillJob:
    """A routed request on its prefill instance; ``done`` counts computed tokens (reused
    tokens count as done from the start)."""

    request_id: str
    prompt_len: int
    reused: int
    ready_at: float
    done: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        self.done = self.reused


class PrefillInstance:
    """See the module doc. Call :meth:`submit`, then :meth:`poke` whenever time advances to an
    event of this instance; :meth:`poke` returns when it next needs to be poked."""

    def __init__(
        self,
        instance_id: str,
        model: PrefillTimeModel,
        chunk_tokens: int,
        batch_tokens: int,
        on_start: Callable[[str, float], None],
        on_done: Callable[[PrefillJob, float], None],
    ) -> None:
        self.instance_id = instance_id
        self._c = model.coefficients
        self._chunk = chunk_tokens
        self._budget = batch_tokens
        self._on_start = on_start
        self._on_done = on_done
        self._queue: deque[PrefillJob] = deque()
        self._step: list[tuple[PrefillJob, int]] | None = None
        self._step_end = 0.0
        self.busy_s = 0.0
        self.steps = 0
        self.served = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, job: PrefillJob) -> None:
        self._queue.append(job)

    def poke(self, now: float) -> float | None:
        """Finish the running step if it ends by ``now``, then start the next one if any job is
        ready. Returns the time of this instance's next event (a step end, or the earliest
        pull arrival when nothing is ready), or None when it has nothing to do."""
        if self._step is not None:
            if now < self._step_end:
                return self._step_end
            self._finish_step(self._step_end)
        return self._start_step(now)

    def _start_step(self, now: float) -> float | None:
        c0, c1, c2, c3 = self._c
        budget = self._budget
        chunks: list[tuple[PrefillJob, int]] = []
        cost = c0
        wake: float | None = None
        chunk = self._chunk
        for job in self._queue:
            if job.ready_at > now:
                if wake is None or job.ready_at < wake:
                    wake = job.ready_at
                continue
            # take = min(chunk, left, budget), without the call (ints: the same value)
            take = job.prompt_len - job.done
            if chunk < take:
                take = chunk
            if budget < take:
                take = budget
            if take <= 0 and job.prompt_len > job.done:
                break
            a = job.done
            cost += c1 * take + c2 * take * (2 * a + take)
            if not job.started:
                job.started = True
                cost += c3 * job.reused
                self._on_start(job.request_id, now)
            chunks.append((job, take))
            budget -= take
            if budget <= 0:
                break
        if not chunks:
            return wake
        duration = cost if cost > 0.0 else 0.0  # max(0.0, cost)
        self._step = chunks
        self._step_end = now + duration
        self.busy_s += duration
        self.steps += 1
        return self._step_end

    def _finish_step(self, at: float) -> None:
        assert self._step is not None
        finished = False
        for job, take in self._step:
            job.done += take
            finished = finished or job.done >= job.prompt_len
        self._step = None
        if not finished:
            return
        remaining: deque[PrefillJob] = deque()
        for job in self._queue:
            if job.done >= job.prompt_len:
                self.served += 1
                self._on_done(job, at)
            else:
                remaining.append(job)
        self._queue = remaining
