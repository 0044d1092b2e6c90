"""Several choices for one prompt (OpenAI's ``n`` and ``best_of``), sharing the prompt's KV.

The first choice runs alone until its first token: by then its prefill has computed the
prompt and stored the prompt's full blocks in kvdb, so the other choices start with the
prefix cached (the point of this system: the prompt is computed once, not n times; only the
last partial block is recomputed). Each choice has its own seed stream: ``seed + i`` when the
caller gave a seed (the same request gives the same texts), else one derived from its own
request id. Usage counts the prompt once and every choice's completion tokens (OpenAI's rule).

Also where a request's grammar is compiled before it is queued (``start_generation``): off
the event loop, so a large schema never stalls other requests, and a bad grammar is a 400
before any work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kvflow.stages.api.generation import Chunk, GenerateInput, Generation, Usage
from kvflow.stages.engine import GrammarError, GrammarSpec
from kvflow.stages.errors import InvalidArgument

MAX_CHOICES = 16
"""The most choices (n, best_of) one request may ask for."""


async def check_grammar(frontend: Any, inp: GenerateInput) -> None:
    """Compile ``inp``'s grammar (if any) in a worker thread with the frontend's compiler, so
    the engine's own compile is a cache hit; InvalidArgument names what is wrong."""
    spec = inp.sampling.get("grammar")
    if spec is None:
        return
    if not isinstance(spec, GrammarSpec):
        raise InvalidArgument(f"grammar must be a GrammarSpec, got {type(spec).__name__}")
    compiler = getattr(frontend, "grammars", None)
    if compiler is None:
        raise InvalidArgument("this server cannot apply a grammar (structured output)")
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except GrammarError as exc:
        raise InvalidArgument(str(exc)) from None


async def start_generation(frontend: Any, inp: GenerateInput) -> Generation:
    """A Generation of ``inp`` with its grammar checked first (see check_grammar)."""
    await check_grammar(frontend, inp)
    return Generation(frontend, inp)


@dataclasses.dataclass
class Choice:
    """One choice's generation and what it produced so far (filled by ``Choices``)."""

    index: int
    gen: Generation
    chunks: list[Chunk] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for c in self.chunks for lp in c.logprobs)


class Choices:
    """``count`` generations of one input; ``keep`` of them are answered (best_of keeps the
    ``keep`` with the highest cumulative logprob; otherwise keep == count)."""

    def __init__(self, choices: list[Choice], first: AsyncIterator[Chunk], keep: int) -> None:
        self.choices = choices
        self._first = first
        self.keep = keep

    @classmethod
    async def start(cls, frontend: Any, inp: GenerateInput, count: int, keep: int) -> Choices:
        """Start the first choice and wait for its first chunk (errors raise here, before an
        HTTP status is sent), then the others. InvalidArgument for a bad count."""
        if not 1 <= keep <= count <= MAX_CHOICES:
            raise InvalidArgument(f"n and best_of must satisfy 1 <= n <= best_of <= {MAX_CHOICES}")
        first_gen = await start_generation(frontend, _nth(inp, 0))
        first = first_gen.chunks()
        head: list[Chunk] = []
        with contextlib.suppress(StopAsyncIteration):
            head.append(await anext(first))
        choices = [Choice(0, first_gen)]
        try:
            for i in range(1, count):
                choices.append(Choice(i, Generation(frontend, _nth(inp, i))))
        except BaseException:
            await first.aclose()  # type: ignore[attr-defined]
            for c in choices[1:]:
                c.gen.cancel("a sibling choice was refused")
            raise
        return cls(choices, _chain(head, first), keep)

    def streams(self) -> list[AsyncIterator[Chunk]]:
        """Each choice's chunk iterator, in index order (iterate each once)."""
        return [self._first, *(c.gen.chunks() for c in self.choices[1:])]

    async def merged(self) -> AsyncIterator[tuple[int, Chunk]]:
        """(choice index, chunk) as each choice produces them; every choice is ended if the
        caller stops early. Only for keep == count (best_of cannot stream)."""
        queue: asyncio.Queue[tuple[int, Chunk | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, it: AsyncIterator[Chunk]) -> None:
            try:
                async for chunk in it:
                    self.choices[i].chunks.append(chunk)
                    await queue.put((i, chunk))
                await queue.put((i, None))
            except BaseException as exc:
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(self.streams())]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self) -> list[Choice]:
        """Run every choice to its end; the answered ones, re-indexed from 0 (best_of: the
        ``keep`` with the highest cumulative logprob, best first)."""
        async for _ in self.merged():
            pass
        kept = self.choices
        if self.keep < len(kept):
            kept = sorted(kept, key=lambda c: c.cumulative_logprob, reverse=True)[: self.keep]
        return [dataclasses.replace(c, index=i) for i, c in enumerate(kept)]

    def usage(self) -> Usage:
        """The first choice's usage with every choice's completion tokens added."""
        first = self.choices[0].gen.usage()
        total = sum(c.gen.usage().completion_tokens for c in self.choices)
        return dataclasses.replace(first, completion_tokens=total)


def _nth(inp: GenerateInput, i: int) -> GenerateInput:
    """The input of choice i: its own seed stream (seed + i when a seed was given)."""
    if i == 0:
        return inp
    seed = inp.sampling.get("seed")
    sampling = dict(inp.sampling)
    if seed is not None:
        sampling["seed"] = (int(seed) + i) % 2**64
    rid = f"{inp.request_id}-{i}" if inp.request_id else ""
    return dataclasses.replace(inp, sampling=sampling, request_id=rid)


async def _chain(head: list[Chunk], rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    try:
        for chunk in head:
            yield chunk
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
