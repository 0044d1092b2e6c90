"""Whether the embedded server runs one engine per prefill/decode pair: one place decides.

Disaggregated (the design's main path, and every cluster): a prefill and a decode engine,
each with its own weights and worker thread. In one process on a small machine the two
compete for the same few cores: the decode engine steps at a small batch beside a
compute-bound prefill, reading every weight once a step on a core the prefill wanted.

Colocated (``--colocate``): one engine per pair, every core, each step one forward pass over
the prefill chunks and the decode batch (segments.py), so the weights are read once for both
and no thread waits on another engine's. While requests decode, a step's prefill budget is
at most ``COLOCATED_MIXED_CHUNK`` tokens (the running streams wait for each step), or, with
``--tbt-target-ms``, as many as fit a step of that time by measured step times
(engine/step_budget.py; off by default: in the side-by-side benchmark a 200 ms target cost
the concurrency rows 17-36%, docs/performance.md); a prompt alone gets the full
``--prefill-chunk``. The decode takes
over the prefill's KV pages in place (``state.py:GenerateState.colocated``): nothing staged.

On a GPU (``--device cuda``) two engines in one process contend for the interpreter lock
instead: each step is many short launches from Python, and a decode engine stepping at a
small batch held the prefill engine's 512-token steps at 54 ms against 7-11 ms alone (an
H200, docs/performance.md "On a GPU"); colocated, the same load was served at 1.5-1.9x the
rate.

The step sizes (``--prefill-chunk`` 1024, ``COLOCATED_MIXED_CHUNK`` 512; measured with
``bench-side --interleave`` on a 2-core machine against 512 / 256, docs/performance.md "Step
sizes"): the bigger steps finished 8 long prompts and a 32-client burst 4-6% sooner and
answered 8 clients' first tokens 5-10% sooner, at about twice the time between tokens of a
stream that decodes beside a long prompt.

The rule (measured on a 2-core machine, docs/performance.md "Concurrency", and on an H200):
the embedded server colocates by default when it has as many prefill as decode instances
and its engines run on a GPU or on at most ``SMALL_MACHINE_CORES`` cores;
``--colocate`` / ``--no-colocate`` decide outright.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SMALL_MACHINE_CORES = 2
COLOCATED_MIXED_CHUNK = 512


def embedded_colocate(
    requested: bool | None, num_prefill: int, num_decode: int, ncores: int, device: str = "cpu"
) -> bool:
    """Whether an embedded server of ``num_prefill`` + ``num_decode`` instances on ``ncores``
    cores, its engines on ``device``, colocates; ``requested`` (the flag) decides when given."""
    if requested is not None:
        return requested
    small = ncores <= SMALL_MACHINE_CORES or device != "cpu"
    chosen = small and num_prefill == num_decode
    logger.info(
        "embedded server: %s (%d cores, engines on %s; --colocate / --no-colocate decide outright)",
        "colocated: one engine per prefill/decode pair" if chosen else "disaggregated",
        ncores,
        device,
    )
    return chosen


def mixed_chunk(colocate: bool, given: int | None) -> int | None:
    """The prefill budget of a step that also decodes: as given, else
    ``COLOCATED_MIXED_CHUNK`` for a colocated engine (a disaggregated engine never mixes a
    prompt into a decode step, so None: its ``prefill_chunk``)."""
    if given is not None:
        return given
    return COLOCATED_MIXED_CHUNK if colocate else None


def decode_staging_used(colocate: bool, num_prefill: int, num_decode: int) -> bool:
    """Whether the decode instances' staging areas of an embedded server take prompts' pages.
    Not when one colocated pair is all there is: its decode always adopts the prefill's pages
    in place (``GenerateState.colocated``), so its staging area is left unmapped rather than
    written at start (one sequence's pages: 180 MiB on the default model). With several
    pairs the router may pair a prefill with another pair's decode, which stages."""
    return not (colocate and num_prefill == 1 and num_decode == 1)


def tbt_target_ms(given: float | None) -> float | None:
    """The target step time that sizes a mixed step's prompt budget: as given; None or 0:
    none, the fixed mixed chunk (the default, colocated or not: measured, a target trades the
    throughput of every concurrent row for steadier streams beside a long prompt)."""
    return given or None
