"""Measure an engine's prefill and decode times and fit the conductor's time models.

The prefill model is fitted to (prompt length, reused length) -> seconds, timed through the
same path as serving: the reused prefix is imported from exported pages, the suffix is computed
in chunks, and the clock stops at the first token. The decode model is fitted to (batch size,
context tokens) -> seconds per step.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvflow.router import (
    DecodeSample,
    DecodeTimeModel,
    PrefillTimeModel,
    Profile,
    ProfileSample,
)
from kvflow.stages.engine import Engine, SamplingParams

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ProfileGrid:
    """Which points to time. Prompt lengths are rounded down to whole blocks."""

    prompt_lens: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    reuse_fractions: tuple[float, ...] = (0.0, 0.5, 0.9)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (256, 1024)
    decode_steps: int = 8
    repeats: int = 1
    seed: int = 0


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _run(engine: Engine, rid: str) -> None:
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return


def time_prefill(engine: Engine, tokens: Sequence[int], reused: int) -> float:
    """Seconds from add_request to the first token, with ``reused`` tokens imported."""
    pages: list[torch.Tensor] = []
    if reused:
        engine.add_request(
            "profile-src", tokens[:reused], SamplingParams(max_tokens=1), retain_pages=True
        )
        _run(engine, "profile-src")
        pages = [
            engine.export_page("profile-src", b).clone() for b in range(reused // engine.block_size)
        ]
        engine.release("profile-src")
    start = time.perf_counter()
    engine.add_request(
        "profile",
        tokens,
        SamplingParams(max_tokens=1),
        prefix_pages=pages,
        num_prefix_tokens=reused,
    )
    _run(engine, "profile")
    return time.perf_counter() - start


def time_decode(
    engine: Engine, batch: int, context: int, steps: int, rng: random.Random, vocab: int
) -> float:
    """Mean seconds of one decode step of ``batch`` requests with ``context`` tokens each."""
    rids = [f"profile-d{i}" for i in range(batch)]
    # Early requests decode while later ones still prefill: leave them room to.
    prefill_steps = -(-batch * context // engine.config.prefill_chunk)
    budget = min(engine.max_model_len - context, steps + prefill_steps + 8)
    sampling = SamplingParams(max_tokens=budget, ignore_eos=True)
    for rid in rids:
        engine.add_request(rid, _tokens(rng, context, vocab), sampling)
    while any(engine.num_computed_tokens(r) < context for r in rids):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return elapsed


def profile_engine(engine: Engine, grid: ProfileGrid, progress: Progress | None = None) -> Profile:
    """Time the grid on ``engine`` (which must be idle) and fit both models."""
    rng = random.Random(grid.seed)
    vocab = min(engine.spec.vocab_size, 32000)
    bs = engine.block_size
    say = progress or (lambda msg: logger.info("%s", msg))
    prefill: list[ProfileSample] = []
    time_prefill(engine, _tokens(rng, 2 * bs, vocab), 0)  # warm-up
    for n in grid.prompt_lens:
        n = max(bs, (min(n, engine.max_model_len - 1) // bs) * bs)
        for frac in grid.reuse_fractions:
            reused = int(n * frac) // bs * bs
            if reused >= n:
                reused = n - bs
            for _ in range(grid.repeats):
                seconds = time_prefill(engine, _tokens(rng, n, vocab), reused)
                prefill.append(ProfileSample(n, reused, seconds))
                say(f"prefill n={n} reused={reused}: {seconds * 1000:.1f} ms")
    decode: list[DecodeSample] = []
    for batch in grid.decode_batches:
        for context in grid.decode_contexts:
            if context + grid.decode_steps + 1 > engine.max_model_len:
                continue
            seconds = time_decode(engine, batch, context, grid.decode_steps, rng, vocab)
            decode.append(DecodeSample(batch, context * batch, seconds))
            say(f"decode batch={batch} context={context}: {seconds * 1000:.2f} ms/step")
    model_id = engine.model_fingerprint
    return Profile(
        PrefillTimeModel.fit(prefill, model_id=model_id),
        DecodeTimeModel.fit(decode, model_id=model_id),
    )
