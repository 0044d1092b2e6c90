"""Side by side: issue 31's table, kvflow against another OpenAI-compatible server, one run.

``kvflow serve`` (started here, ``--model``: the tiny demo model by default, ``default`` for
SmolLM2-135M-Instruct; the demo model gets a plain ChatML chat template) and then, after it
stopped, the server that ``--compare-cmd`` starts (e.g. vLLM's CPU build on the same
weights), or one already at ``--compare-url``. Both get the
same seeded prompts, sized in tokens with the model's own tokenizer, through streamed OpenAI
requests (chat where the row is chat) at temperature 0:

- start-up: the server's process start to its first served request;
- TTFT, cold prompt of ~512 tokens; cold ~2,000 tokens (each the median of ``--cold-samples``
  prompts); the first of those 2,000 tokens again (a prefix hit); each cold prompt its own
  seeded text, so nothing is a prefix hit by accident;
- TTFT of 7 chat questions after a shared ~1,500-token system prompt (primed by one question
  first; the median of the 7);
- decode, one request: output tokens/s between the first and the last token;
- 8 concurrent clients: output tokens/s and TTFT p99;
- 8 concurrent clients with one long (~2,000-token) prompt each, and 8 whose prompts share
  a ~1,500-token prefix, primed by one request first (issue 26's rows): output tokens/s and
  TTFT p99; for the long prompts also the p99 of the gaps between a stream's consecutive
  tokens (what the streams already running pay while the other prompts are computed);
- 32 clients x 2 requests of ~505-token prompts: the time until all are done.

Before the first row each server serves one untimed cold prompt (``--settle-tokens``; with
``--interleave`` once both servers are up), so that no row pays a server's first large
forward pass after an idle spell.

Also: whether the two servers' greedy texts are the same, request by request; what each said
of its prefix cache (Prometheus counters, the other server's logged ``enable_prefix_caching``,
the cached tokens of the prefix-hit row where the server reports them). ``--rounds 2`` runs a
second round with the next seed and the other order. Prints one summary line per server and
round, then the ratio table (kvflow / other); ``--json PATH`` writes every number.

    python -m kvflow.tools.bench.side --model DIR --compare-url http://127.0.0.1:8391 \\
        --compare-model-name DIR --compare-cmd "python -m vllm.entrypoints.openai.api_server \\
        --model DIR --dtype float32 --host 127.0.0.1 --port 8391" --json side.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvflow.tools.bench import _cli
from kvflow.tools.bench._cores import QUIET_BUSY, wait_quiet
from kvflow.tools.bench._servers import (
    Server,
    add_compare_arguments,
    against_other,
    log_tail,
    model_dir,
    scrape,
    start_embedded,
    stop_embedded,
)
from kvflow.tools.bench._stream import Outcome, one_request
from kvflow.tools.bench.load import Level, Target, closed_loop, pct

logger = logging.getLogger(__name__)
T = TypeVar("T")

VOCAB = [
    word
    for line in (
        "the a of to and in on for with from by at",
        "as is was are were be been has have had it this",
        "that these those river mountain city garden window paper music light stone",
        "water forest market story letter morning evening winter summer bridge station kitchen",
        "teacher doctor farmer sailor engine signal record number table chair road field",
        "cloud storm harbor island quiet bright early late slow quick small large",
        "green blue old new warm cold simple careful walks reads builds finds",
        "brings keeps opens closes writes carries follows remembers",
    )
    for word in line.split()
]
QUESTIONS = (
    "What is the main idea?", "Who is the story about?", "Where does it happen?",
    "Why does the engine stop?", "Which season is it?", "How long is the road?",
    "What does the teacher bring?", "When does the storm come?", "Name one colour.",
)  # fmt: skip
GREEDY = {"temperature": 0}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KVFLOW_CACHE = ("kvflow_cached_tokens_total", "kvflow_prompt_tokens_total")
VLLM_CACHE = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


class Texts:
    """Seeded prompt text of about N tokens of the model's tokenizer; each ``key`` (a row)
    draws from its own seed, so two keys' texts share no prefix."""

    def __init__(self, model: Path, seed: int) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        self._seed = seed

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def text(self, key: str, tokens: int) -> str:
        """The longest prefix of ``key``'s seeded word stream that is at most ``tokens``."""
        rng = random.Random(f"{self._seed}-{key}")
        words: list[str] = []

        def fits(n: int) -> bool:
            words.extend(rng.choice(VOCAB) for _ in range(n - len(words)))
            return self.count(" ".join(words[:n])) <= tokens

        hi = 8
        while fits(hi):
            hi *= 2
        lo = hi // 2 if hi > 8 else 0  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return " ".join(words[: max(lo, 1)]).capitalize() + "."


@dataclass
class Row:
    """One row of the table: its name, what it shows, its unit and which way is better."""

    name: str
    label: str
    unit: str
    lower_is_better: bool


BURST = "{burst} clients x {burst_requests} requests, ~{burst_tokens}-token prompts: all done"
ROWS = [
    Row("startup_s", "start-up (process start to first served request)", "s", True),
    Row("ttft_cold_short_s", "TTFT, cold ~{cold} tokens{median}", "s", True),
    Row("ttft_cold_long_s", "TTFT, cold ~{long} tokens{median}", "s", True),
    Row("ttft_hit_long_s", "TTFT, the same ~{long} tokens again (prefix hit)", "s", True),
    Row(
        "ttft_system_s",
        "TTFT, {questions} chat questions after a ~{system}-token system prompt (median)",
        "s",
        True,
    ),
    Row("decode_tok_s", "decode, one request", "tok/s", False),
    Row("clients_tok_s", "{clients} concurrent clients: output", "tok/s", False),
    Row("clients_ttft_p99_s", "{clients} concurrent clients: TTFT p99", "s", True),
    Row("long_tok_s", "{clients} clients, one ~{long}-token prompt each: output", "tok/s", False),
    Row("long_ttft_p99_s", "{clients} clients, one ~{long}-token prompt each: TTFT p99", "s", True),
    Row(
        "long_tbt_p99_s",
        "{clients} clients, one ~{long}-token prompt each: time between tokens p99",
        "s",
        True,
    ),
    Row("shared_tok_s", "{clients} clients, shared ~{system}-token prefix: output", "tok/s", False),
    Row(
        "shared_ttft_p99_s", "{clients} clients, shared ~{system}-token prefix: TTFT p99", "s", True
    ),
    Row("burst_all_done_s", BURST, "s", True),
]


@dataclass
class Run:
    """One server's pass over the rows: the values, every served text by key, every
    request's outcome status, and what it said of its prefix cache."""

    values: dict[str, float | None] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int | None] = field(default_factory=dict)  # as the server said
    prefix_cache: dict[str, Any] = field(default_factory=dict)
    groups_at: dict[str, float] = field(default_factory=dict)  # row group -> its start (epoch s)
    quiet_s: dict[str, float] = field(default_factory=dict)  # row group -> wait for quiet cores
    samples: dict[str, list[float | None]] = field(default_factory=dict)  # cold row -> TTFTs

    def keep(self, key: str, outcome: Outcome) -> Outcome:
        if outcome.status == "200":
            self.texts[key] = outcome.text
            self.prompt_tokens[key] = outcome.prompt_tokens
        else:
            self.failed[outcome.status] = self.failed.get(outcome.status, 0) + 1
        return outcome

    def keep_level(self, row: str, level: Level, names: dict[str, str]) -> None:
        for prompt, text in level.outputs.items():
            self.texts[f"{row}/{names[prompt]}"] = text
        for o in level.outcomes:
            if o.status != "200":
                self.failed[o.status] = self.failed.get(o.status, 0) + 1


async def first_served(target: Target, deadline_s: float) -> float:
    """Sends a one-token completion until one is served; returns when (perf_counter)."""
    import aiohttp

    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        while True:
            o = await one_request(session, target.url, target.model, "Hello", 1, GREEDY)
            if o.status == "200":
                return time.perf_counter()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{target.url} served no request: last answer {o.status}")
            await asyncio.sleep(0.25)


ROW_GROUPS = ("single", "clients", "long", "shared", "burst")
"""``--rows`` choices: the single-request rows (TTFT and decode), then each concurrency row."""


async def rows(
    args: argparse.Namespace, target: Target, texts: Texts, run: Run,
    groups: list[str] | None = None, cold: bool = True,
) -> None:  # fmt: skip
    """Every row of ``groups`` (default ``args.rows``) but start-up, in the table's order,
    against ``target``; with ``cold`` False, the single-request group without its cold
    samples (the caller took them)."""
    chosen = set(args.rows if groups is None else groups)

    def starts(group: str) -> bool:
        if group in chosen:
            run.groups_at[group] = time.time()
        return group in chosen

    if starts("single"):
        await _single_rows(args, target, texts, run, cold)
    if starts("clients"):
        await _level(args, target, texts, run, "clients", args.client_prompt_tokens)
    if starts("long"):
        await _level(args, target, texts, run, "long", args.long_tokens, per_client=1, tbt=True)
    if starts("shared"):
        prefix = texts.text("shared-prefix", args.system_tokens) + " "
        await _prime(target, run, prefix + texts.text("shared-prime", args.tail_tokens))
        await _level(args, target, texts, run, "shared", args.tail_tokens, prefix=prefix)
    if starts("burst"):
        burst = [
            [texts.text(f"burst-{c}-{r}", args.burst_tokens) for r in range(args.burst_requests)]
            for c in range(args.burst)
        ]
        level = await closed_loop(target, burst, args.burst_max_tokens, "burst", GREEDY)
        run.keep_level("burst", level, _names(burst))
        done = level.summary()["served"] == level.summary()["requests"]
        run.values["burst_all_done_s"] = level.wall_s if done else None


COLD_KEYS = {"ttft_cold_short_s": ("cold-short", "cold_short"),
             "ttft_cold_long_s": ("cold-long", "cold_long")}  # fmt: skip
"""Each cold row's seeded text key and served text key (sample i > 0 appends ``-i`` / ``/i``)."""


async def _kept(
    session: Any, target: Target, run: Run, key: str, prompt: str | list[dict[str, str]],
    tokens: int,
) -> Outcome:  # fmt: skip
    """One greedy streamed request to ``target`` (chat for a message list), its outcome kept
    in ``run`` under ``key``."""
    o = await one_request(session, target.url, target.model, prompt, tokens, GREEDY)
    return run.keep(key, o)


def _ttft(o: Outcome) -> float | None:
    return o.ttft_s if o.status == "200" else None


async def cold_sample(
    args: argparse.Namespace, target: Target, texts: Texts, run: Run, i: int
) -> None:  # fmt: skip
    """Sample ``i`` of the two cold TTFT rows: a ~``--cold-tokens`` and a ~``--long-tokens``
    prompt, each its own seeded text (sample 0 first serves two short warm-up prompts). The
    rows' values are the medians over ``--cold-samples`` samples, set after each one, None
    while any sample failed."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:

        async def one(key: str, prompt: str, tokens: int) -> Outcome:
            return await _kept(session, target, run, key, prompt, tokens)

        if i == 0:
            for w in range(2):  # warm-up: short prompts of their own
                await one(f"warmup/{w}", texts.text(f"warmup-{w}", 32), args.ttft_max_tokens)
        for row, (text_key, served_key) in COLD_KEYS.items():
            size = args.cold_tokens if row == "ttft_cold_short_s" else args.long_tokens
            mine = (text_key, served_key) if i == 0 else (f"{text_key}-{i}", f"{served_key}/{i}")
            o = await one(mine[1], texts.text(mine[0], size), args.ttft_max_tokens)
            samples = run.samples.setdefault(row, [])
            samples.append(_ttft(o))
            served = [s for s in samples if s is not None]
            run.values[row] = statistics.median(served) if len(served) == len(samples) else None


async def _single_rows(
    args: argparse.Namespace, target: Target, texts: Texts, run: Run, cold: bool = True
) -> None:  # fmt: skip
    """The one-request-at-a-time rows: the cold TTFT samples (unless ``cold`` is False: the
    caller took them), then prefix-hit TTFT, a system prompt, decode."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(key: str, prompt: str | list[dict[str, str]], tokens: int) -> Outcome:
            return await _kept(session, target, run, key, prompt, tokens)

        if cold:
            for i in range(args.cold_samples):
                await cold_sample(args, target, texts, run, i)
        long = texts.text(COLD_KEYS["ttft_cold_long_s"][0], args.long_tokens)  # sample 0's
        hit = await one("hit_long", long, args.ttft_max_tokens)
        run.values["ttft_hit_long_s"] = _ttft(hit)
        run.prefix_cache["hit_row_cached_tokens"] = hit.cached_tokens
        system = texts.text("system", args.system_tokens)
        times = []
        for q in range(args.questions + 1):  # question 0 primes the system prompt
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": QUESTIONS[q % len(QUESTIONS)] + f" ({q})"},
            ]
            o = await one(f"system/{q}", messages, args.ttft_max_tokens)
            if q and o.status == "200":
                times.append(o.ttft_s)
        run.values["ttft_system_s"] = statistics.median(times) if times else None
        d = await one("decode", texts.text("decode", 48), args.decode_max_tokens)
        run.values["decode_tok_s"] = 1 / d.tpot_s if d.status == "200" and d.tpot_s else None


async def _prime(
    target: Target, run: Run, prompt: str, name: str = "prime", tokens: int = 1
) -> None:
    """One untimed request before a row (by default one that puts a shared prefix in the
    server's cache); its text is kept under ``name``."""
    level = await closed_loop(target, [[prompt]], tokens, name, GREEDY)
    run.keep_level(name, level, {prompt: "0"})


def settle(args: argparse.Namespace, server: Server, texts: Texts, run: Run) -> None:
    """Untimed, once a server is up: one cold prompt of ``--settle-tokens`` (its own seeded
    text, a prefix of no row's) served and dropped, so that no timed row pays the server's
    first large forward pass (its buffers, its pages) after an idle spell."""
    size = args.long_tokens if args.settle_tokens is None else args.settle_tokens
    if size > 0:
        prompt = texts.text("settle", size)
        asyncio.run(_prime(Target.of(server), run, prompt, "settle", args.ttft_max_tokens))


async def _level(
    args: argparse.Namespace, target: Target, texts: Texts, run: Run, row: str, tokens: int,
    prefix: str = "", per_client: int | None = None, tbt: bool = False,
) -> None:  # fmt: skip
    """``args.clients`` concurrent clients, ``per_client`` prompts each (default
    ``args.client_requests``), each ``prefix`` and then about ``tokens`` tokens of its own.
    With ``tbt``, also the p99 of the gaps between consecutive tokens of every stream (how
    long a running stream waits while the others' prompts are computed)."""
    n = per_client or args.client_requests
    prompts = [
        [prefix + texts.text(f"{row}-{c}-{r}", tokens) for r in range(n)]
        for c in range(args.clients)
    ]
    level = await closed_loop(target, prompts, args.client_max_tokens, row, GREEDY)
    run.keep_level(row, level, _names(prompts))
    s = level.summary()
    ok = s["served"] == s["requests"]
    run.values[f"{row}_tok_s"] = s["goodput_tokens_per_s"] if ok else None
    ttfts = [o.ttft_s for o in level.outcomes if o.status == "200"]
    run.values[f"{row}_ttft_p99_s"] = pct(ttfts, 99) if ok else None
    if tbt:
        gaps = [g for o in level.outcomes if o.status == "200" for g in o.gaps]
        run.values[f"{row}_tbt_p99_s"] = pct(gaps, 99) if ok and gaps else None


def _names(prompts: list[list[str]]) -> dict[str, str]:
    return {p: f"{c}-{r}" for c, mine in enumerate(prompts) for r, p in enumerate(mine)}


def _prefix_counters(url: str | None, names: tuple[str, str]) -> dict[str, float] | None:
    """(hit, queried) prompt tokens from the server's Prometheus counters, None if absent."""
    if url is None:
        return None
    try:
        found = scrape(url, names)
    except OSError:
        return None
    if not found:
        return None
    return {"hit_tokens": found.get(names[0], 0.0), "queried_tokens": found.get(names[1], 0.0)}


def measure(args: argparse.Namespace, server: Server, texts: Texts, kvflow: bool) -> Run:
    """Start-up (the server was started at ``server.started_at``), then every row."""
    run = started_up(args, server)
    settle(args, server, texts, run)
    asyncio.run(rows(args, Target.of(server), texts, run))
    cache_report(server, run, kvflow)
    return run


def started_up(args: argparse.Namespace, server: Server) -> Run:
    """A new Run holding ``server``'s start-up: its process start to its first served
    request."""
    run = Run()
    served_at = asyncio.run(first_served(Target.of(server), args.compare_start_s))
    run.values["startup_s"] = served_at - server.started_at if server.started_at else None
    return run


def cache_report(server: Server, run: Run, kvflow: bool) -> None:
    """What ``server`` said of its prefix cache, into ``run``."""
    metrics = server.metrics_url if kvflow else server.url + "/metrics"
    run.prefix_cache["counters"] = _prefix_counters(metrics, KVFLOW_CACHE if kvflow else VLLM_CACHE)
    if server.log is not None and not kvflow:
        found = re.findall(r"enable_prefix_caching=(\w+)", log_tail(server.log, 10**6))
        run.prefix_cache["logged_enable_prefix_caching"] = found[0] if found else None


def with_kvflow(model: Path, data_dir: Path, flags: str, use: Callable[[Server], T]) -> T:
    """``use`` of a ``kvflow serve`` started with ``flags`` (one string), stopped after."""
    server = start_embedded(model, data_dir, flags.split())
    try:
        return use(server)
    finally:
        stop_embedded(server.proc)


def with_other(
    args: argparse.Namespace, where: Path, model: Path, use: Callable[[Server, bool], T]
) -> T:
    """``use(server, is_kvflow)`` of the other column's server: kvflow again with
    ``--compare-server-args``, else the one at ``--compare-url`` (started by
    ``--compare-cmd`` where given); stopped after where started here."""
    if args.compare_server_args is not None:
        return with_kvflow(model, where, args.compare_server_args, lambda s: use(s, True))
    return against_other(args, where, lambda s: use(s, False))


def run_kvflow(args: argparse.Namespace, model: Path, data_dir: Path, texts: Texts) -> Run:
    return with_kvflow(
        model, data_dir, args.server_args, lambda s: measure(args, s, texts, kvflow=True)
    )


def run_other(args: argparse.Namespace, log_dir: Path, texts: Texts, model: Path) -> Run:
    return with_other(args, log_dir, model, lambda s, k: measure(args, s, texts, kvflow=k))


def run_interleaved(
    args: argparse.Namespace, model: Path, where: Path, texts: Texts, first: str
) -> dict[str, Run]:
    """Both servers up at once (kvflow started first, then the other, each start-up timed
    while the other server idles); then each row group runs on one server and then on the
    other, ``first`` first in the first group and the order swapped in every next group
    (A B, B A, A B, ...), so that a change in the machine's pace lands on both columns; each
    server's group first waits for quiet cores (``wait_quiet``, ``--quiet-s``). The cold
    TTFT rows' samples take turns the same way, sample by sample, before the rest of the
    single-request group: each sample is one prompt, so the pace of one moment decides it."""
    second = "other" if first == "kvflow" else "kvflow"
    groups = [g for g in ROW_GROUPS if g in set(args.rows)]

    def both(kvflow: Server) -> dict[str, Run]:
        runs = {"kvflow": started_up(args, kvflow)}

        def alternate(other: Server, other_is_kvflow: bool) -> dict[str, Run]:
            runs["other"] = started_up(args, other)
            servers = {"kvflow": kvflow, "other": other}
            for who in (first, second):  # after both start-ups: each one's idle spell ends
                settle(args, servers[who], texts, runs[who])
            for g, group in enumerate(groups):
                if group == "single":  # its cold samples first, the servers taking turns
                    for i in range(args.cold_samples):
                        for who in (first, second) if i % 2 == 0 else (second, first):
                            run = runs[who]
                            run.quiet_s[f"cold/{i}"] = wait_quiet(args.quiet_s)
                            run.groups_at[f"cold/{i}"] = time.time()
                            target = Target.of(servers[who])
                            asyncio.run(cold_sample(args, target, texts, run, i))
                for who in (first, second) if g % 2 == 0 else (second, first):
                    runs[who].quiet_s[group] = wait_quiet(args.quiet_s)
                    target = Target.of(servers[who])
                    asyncio.run(rows(args, target, texts, runs[who], [group], cold=False))
            cache_report(kvflow, runs["kvflow"], kvflow=True)
            cache_report(other, runs["other"], kvflow=other_is_kvflow)
            return runs

        return with_other(args, where / "other", model, alternate)

    return with_kvflow(model, where / "kvflow", args.server_args, both)


def _interleaved_round(
    args: argparse.Namespace, model: Path, where: Path, texts: Texts, order: list[str]
) -> tuple[dict[str, Run], str | None]:
    """One interleaved round: both servers' runs, or none and what went wrong."""
    try:
        return run_interleaved(args, model, where, texts, order[0]), None
    except RuntimeError as e:
        error = f"{e}: {log_tail(where / 'other' / 'compare.log')}"
        print(f"bench-side: {error}", file=sys.stderr)
        return {}, error


def _keep(result: dict[str, Any], who: str, run: Run, i: int) -> None:
    """``who``'s run into the round's ``result``, and its numbers into the log (should a
    later run not finish)."""
    result[who] = {
        "values": run.values, "failed": run.failed, "prefix_cache": run.prefix_cache,
        "prompt_tokens": run.prompt_tokens, "texts": run.texts, "groups_at": run.groups_at,
        "quiet_s": run.quiet_s, "samples": run.samples,
    }  # fmt: skip
    logger.warning(
        "round %d: %s measured: %s", i + 1, who,
        ", ".join(f"{k} {_num(v)}" for k, v in run.values.items() if v is not None),
    )  # fmt: skip


def greedy_match(a: Run, b: Run) -> dict[str, Any]:
    """Requests both servers served, and those whose texts differ (by key)."""
    both = sorted(set(a.texts) & set(b.texts))
    differ = [k for k in both if a.texts[k] != b.texts[k]]
    return {"compared": len(both), "identical": len(both) - len(differ), "differ": differ}


def labels(args: argparse.Namespace) -> dict[str, str]:
    sizes = {
        "cold": args.cold_tokens, "long": f"{args.long_tokens:,}",
        "median": f" (median of {args.cold_samples})" if args.cold_samples > 1 else "",
        "system": f"{args.system_tokens:,}", "questions": args.questions,
        "clients": args.clients, "burst": args.burst,
        "burst_requests": args.burst_requests, "burst_tokens": args.burst_tokens,
    }  # fmt: skip
    return {r.name: r.label.format(**sizes) for r in ROWS}


def table(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: kvflow's and the other's values over the rounds, and kvflow / other."""
    out = []
    names = labels(args)
    for row in ROWS:
        mine = [r["kvflow"]["values"].get(row.name) for r in rounds if "kvflow" in r]
        other = [r["other"]["values"].get(row.name) for r in rounds if "other" in r]
        pairs = zip(mine, other, strict=False)
        ratios = [k / o for k, o in pairs if k is not None and o is not None and o > 0]
        out.append(
            {
                "row": row.name, "label": names[row.name], "unit": row.unit,
                "lower_is_better": row.lower_is_better, "kvflow": mine, "other": other,
                "ratio": ratios,
                "kvflow_ahead": (
                    all((x < 1) if row.lower_is_better else (x > 1) for x in ratios)
                    if ratios else None
                ),
            }
        )  # fmt: skip
    return out


def _span(values: list[Any], fmt: Callable[[float], str]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    lo, hi = min(got), max(got)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def _num(v: float) -> str:
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def _verdict(row: dict[str, Any]) -> str:
    if not row["ratio"]:
        return "-"
    span = _span(row["ratio"], lambda v: f"{v:.2f}")
    lower = row["lower_is_better"]
    behind = all((x > 1) if lower else (x < 1) for x in row["ratio"])
    return f"{span}x (kvflow {'ahead' if row['kvflow_ahead'] else 'behind' if behind else 'mixed'})"


def print_report(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    for i, r in enumerate(doc["rounds"]):
        for who in r["order"]:
            run = r[who]
            vals = ", ".join(
                f"{name} {_num(v)}" for name, v in run["values"].items() if v is not None
            )
            failed = ",".join(f"{k}:{n}" for k, n in sorted(run["failed"].items())) or "none"
            print(f"bench side {who} (round {i + 1}, seed {r['seed']}): {vals}; failed {failed}")
    if not any("other" in r for r in doc["rounds"]):
        return
    print("| | kvflow | other | kvflow/other |\n| --- | --- | --- | --- |")
    for row in doc["table"]:
        unit = " " + row["unit"]
        mine, other = _span(row["kvflow"], _num), _span(row["other"], _num)
        print(f"| {row['label']} | {mine}{unit} | {other}{unit} | {_verdict(row)} |")
    g = doc["greedy"]
    ahead = sum(1 for row in doc["table"] if row["kvflow_ahead"])
    measured = sum(1 for row in doc["table"] if row["ratio"])
    print(
        f"bench side: kvflow ahead on {ahead}/{measured} rows; greedy texts identical in "
        f"{g['identical']}/{g['compared']}; load avg {doc['load_avg'][0]:.2f}",
        flush=True,
    )


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--model",
        help="the model directory both servers serve, or `default` (SmolLM2-135M-Instruct, "
        "imported into a temporary directory); default: the tiny demo model",
    )
    p.add_argument("--server-args", default="", help="more `kvflow serve` flags, one string")
    add_compare_arguments(p)
    p.add_argument(
        "--compare-server-args",
        help="instead of another server: kvflow again with these `kvflow serve` flags (one "
        "string, may be empty) as the other column, for an A/B of two configurations",
    )
    p.add_argument(
        "--rows",
        type=_cli.names_of("row", ROW_GROUPS),
        default=list(ROW_GROUPS),
        help=f"which rows, comma-separated, of {','.join(ROW_GROUPS)} (start-up is always "
        "measured); default: all",
    )
    p.add_argument("--rounds", type=int, default=1, help="round i: seed+i, the order swapped")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="both servers up at once, each row group run on one and then the other, the order "
        "swapped from group to group (default: one server's every row, then the other's)",
    )
    p.add_argument(
        "--quiet-s",
        type=float,
        default=10.0,
        help="interleaved: before each server's row group, wait up to this long for the "
        f"host's cores to be quiet (under {QUIET_BUSY * 100:.0f}%% busy over half a second); "
        "0: no wait",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold-tokens", type=int, default=512, help="the cold short prompt")
    p.add_argument(
        "--cold-samples",
        type=int,
        default=5,
        help="each cold TTFT row is the median of this many cold prompts, each its own seeded "
        "text (interleaved: the servers take turns sample by sample, A B, B A, ...)",
    )
    p.add_argument("--long-tokens", type=int, default=2000, help="cold long prompts")
    p.add_argument("--system-tokens", type=int, default=1500, help="and the shared prefix")
    p.add_argument("--questions", type=int, default=7, help="after the system prompt")
    p.add_argument(
        "--settle-tokens",
        type=int,
        help="an untimed cold prompt of this many tokens served by each server once it is up "
        "(interleaved: once both are), before any row; 0: none; default: --long-tokens",
    )
    p.add_argument("--ttft-max-tokens", type=int, default=8, help="output of the TTFT rows")
    p.add_argument("--decode-max-tokens", type=int, default=128, help="output of the decode row")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--client-requests", type=int, default=2, help="requests per client")
    p.add_argument("--client-prompt-tokens", type=int, default=256, help="their prompts")
    p.add_argument("--client-max-tokens", type=int, default=64, help="their output")
    p.add_argument("--tail-tokens", type=int, default=48, help="after the shared prefix")
    p.add_argument("--burst", type=int, default=32, help="clients of the all-done row")
    p.add_argument("--burst-requests", type=int, default=2, help="requests per client")
    p.add_argument("--burst-tokens", type=int, default=505, help="their prompts")
    p.add_argument("--burst-max-tokens", type=int, default=16, help="their output")
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep the servers' data and logs in a new folder under this one (default: a "
        "temporary directory, removed at the end)",
    )
    p.add_argument("--json", type=Path, help="write every number and text here")
    p.set_defaults(func=run_bench)
    return p


register, main = _cli.entry_points("bench-side", __doc__, add_arguments)


def run_bench(args: argparse.Namespace) -> int:
    if _cli.compare_flags_wrong("bench-side", args):
        return 2
    if args.compare_server_args is not None and args.compare_url:
        print("bench-side: --compare-server-args and --compare-url exclude each other",
              file=sys.stderr)  # fmt: skip
        return 2
    for flag, value in (("--rounds", args.rounds), ("--cold-samples", args.cold_samples)):
        if value < 1:
            print(f"bench-side: {flag} must be at least 1, not {value}", file=sys.stderr)
            return 2
    rounds: list[dict[str, Any]] = []
    error = None
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        if args.work_dir:  # a fresh folder in it: a server's old data would be a cache hit
            args.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="side-", dir=args.work_dir) if args.work_dir else scratch
        model = model_dir(args.model, Path(tmp), args.seed)
        if args.model is None:  # the tiny demo model has no chat template of its own
            (model / "chat_template.jinja").write_text(CHATML)
        for i in range(args.rounds):
            seed = args.seed + i
            texts = Texts(model, seed)
            two = args.compare_url or args.compare_server_args is not None
            order = ["kvflow", "other"] if two else ["kvflow"]
            order = order if i % 2 == 0 else order[::-1]
            result: dict[str, Any] = {"seed": seed, "order": order}
            if args.interleave and two:
                where = Path(tmp) / f"round{i}"
                runs, failure = _interleaved_round(args, model, where, texts, order)
                error = failure or error
            else:
                runs = {}
                for who in order:
                    where = Path(tmp) / f"round{i}-{who}"
                    try:
                        runs[who] = (
                            run_kvflow(args, model, where, texts)
                            if who == "kvflow"
                            else run_other(args, where, texts, model)
                        )
                    except RuntimeError as e:  # the other's numbers are still reported
                        error = f"{who}: {e}: {log_tail(where / 'compare.log')}"
                        print(f"bench-side: {error}", file=sys.stderr)
            for who in order:
                if who in runs:
                    _keep(result, who, runs[who], i)
            result["order"] = [w for w in order if w in result]
            if "kvflow" in result and "other" in result:
                a, b = (Run(texts=result[w]["texts"]) for w in ("kvflow", "other"))
                result["greedy"] = greedy_match(a, b)
            rounds.append(result)
    matched = [r["greedy"] for r in rounds if "greedy" in r]
    doc = {
        "bench": "side",
        "model": str(args.model or "tiny demo model"),
        "server_args": args.server_args,
        "compare_url": args.compare_url,
        "compare_cmd": args.compare_cmd,
        "seed": args.seed,
        "rounds": rounds,
        "table": table(args, rounds),
        "greedy": {
            "compared": sum(g["compared"] for g in matched),
            "identical": sum(g["identical"] for g in matched),
        },
        "error": error,
        "work_dir": tmp if args.work_dir else None,
        "load_avg_start": load_start,
        "load_avg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "args": vars(args),
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=str))
    print_report(args, doc)
    failed = any(r[w]["failed"] for r in rounds for w in r["order"])
    return 1 if error or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
