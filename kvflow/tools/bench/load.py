"""Load benchmark: many HTTP clients against one server, as users would load it.

Two kinds of load through the OpenAI API (``/v1/completions``, streamed):

- closed loop: C clients (``--concurrency``, e.g. 1,8,32,64,128), each sending its next
  request as soon as the last one ended, ``--requests-per-client`` each;
- open loop: Poisson arrivals (seeded) at multiples (``--rates``, e.g. 0.5,1,2,4) of the
  capacity measured by the closed loop (the completed requests per second at its highest
  concurrency), ``--open-requests`` each.

Per level: goodput (requests served per second and their output tokens per second), TTFT and
TPOT p50/p99 of the served ones, the admission queue's mean wait (the server's
``kvflow_admission_queue_seconds``, scraped before and after), and every refusal by its HTTP
status (or ``conn`` for a connection error), and the cores used meanwhile by the server (its
process and descendants, when started here), the clients and every other process on the host
(``_cores.py``: a level slowed by other work shows it). Without ``--url`` it starts ``kvflow serve``
(the embedded server) in a process of its own on free ports, with ``--model`` (default: the
tiny demo model) and stops it at the end.

``--compare-url`` then runs the same levels, same seed and prompts, against any other
OpenAI-compatible server (e.g. vLLM serving the same weights), after kvflow's server has
stopped; with ``--compare-cmd`` the benchmark starts that server itself, waits for its
``/health``, and stops it after, so only one server runs at a time. With ``--interleave`` both
servers are up at once and take turns level by level (kvflow, other; other, kvflow; ...), each
turn after a wait for quiet cores: the two numbers of a level are then measured a minute apart,
not the whole run apart, on a machine whose pace drifts.

Requests carry no temperature unless ``--temperature`` gives one: each server then samples
at its own default (kvflow greedily unless the model's generation_config.json names a
temperature, vLLM at 1.0, the OpenAI API's default); ``--temperature 0`` makes both greedy,
``--temperature 1`` both sampled.

Seeded (prompts, arrivals); prints one summary line; ``--json PATH`` writes every number.

    python -m kvflow.tools.bench.load --concurrency 1,8,64 --rates 0.5,1,2,4
    python -m kvflow.tools.bench.load --url http://127.0.0.1:8000 --metrics-url \\
        http://127.0.0.1:9464/metrics --model-name SmolLM2-135M-Instruct
    python -m kvflow.tools.bench.load --model DIR --compare-url http://127.0.0.1:8011 \\
        --compare-cmd "vllm serve DIR --port 8011" --compare-model-name DIR [--interleave]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.tools.bench import _cli
from kvflow.tools.bench._cores import QUIET_BUSY, CoreMeter, disturbed, wait_quiet
from kvflow.tools.bench._servers import (
    Server,
    add_compare_arguments,
    against_other,
    checkout,
    log_tail,
    model_dir,
    scrape,
    start_embedded,
    stop_embedded,
)
from kvflow.tools.bench._stream import Outcome, one_request

logger = logging.getLogger(__name__)

KEEPALIVE_S = 4.0
"""How long the clients keep an idle connection for the next request: under the 5 s after
which kvflow's HTTP server (``--http-keep-alive-s``) and vLLM's (uvicorn's default) close
one. A client that reuses a connection as the server closes it gets ServerDisconnectedError
for a request the server never read. (A run against kvflow lost one request of 873 to a
connection error whose type was not kept then; this race is the likely cause, not a proven
one.)"""

MAX_TEMPERATURE = 2.0
"""The largest --temperature: the OpenAI API's range is [0, 2]."""

WORDS = ["kv", "cache", "prefix", "block", "token", "store", "tier", "moon"]
WORDS += ["cake", "flow", "page", "decode", "prefill", "route"]


@dataclass
class Level:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    queue_s: float = 0.0  # mean admission wait (server side), when scraped
    cores: dict[str, float] | None = None  # mean cores used: host, server, client, others
    outputs: dict[str, str] = field(default_factory=dict)  # prompt -> its served text

    def summary(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.status == "200"]
        refused: dict[str, int] = {}
        errors: dict[str, int] = {}  # what the connection errors were
        for o in self.outcomes:
            if o.status != "200":
                refused[o.status] = refused.get(o.status, 0) + 1
            if o.error:
                errors[o.error] = errors.get(o.error, 0) + 1
        ttft = [o.ttft_s * 1000 for o in ok]
        tpot = [o.tpot_s * 1000 for o in ok if o.tpot_s is not None]
        wall = max(self.wall_s, 1e-9)
        return {
            "requests": len(self.outcomes),
            "served": len(ok),
            "refused": refused,
            "http_5xx": sum(n for s, n in refused.items() if s.startswith("5")),
            "conn_errors": errors,
            "goodput_rps": len(ok) / wall,
            "goodput_tokens_per_s": sum(o.tokens for o in ok) / wall,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99),
            "queue_mean_ms": self.queue_s * 1000,
            "cores": self.cores,
            "disturbed": disturbed(self.cores),  # other processes used the host's cores
            # prompt tokens the server said it had cached (None: it does not say)
            "cached_prompt_tokens": (
                sum(o.cached_tokens or 0 for o in ok)
                if any(o.cached_tokens is not None for o in ok)
                else None
            ),
            "wall_s": self.wall_s,
        }


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Prompts:
    """The seeded prompts of one run: ``words`` random words each, after the same
    ``prefix_words`` words (a shared system prompt; 0 for none), drawn from their own seed so
    the prompts themselves are the same with or without a prefix."""

    def __init__(self, seed: int, words: int, prefix_words: int = 0) -> None:
        self.rng = random.Random(seed)
        self.words = words
        shared = prompt(random.Random(f"{seed}-prefix"), prefix_words)
        self.prefix = shared + " " if shared else ""

    def next(self) -> str:
        return self.prefix + prompt(self.rng, self.words)

    def take(self, n: int) -> list[str]:
        return [self.next() for _ in range(n)]


class Target:
    """The server's HTTP URL, its model name and (optionally) its metrics URL."""

    def __init__(
        self, url: str, model: str, metrics_url: str | None, pid: int | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.metrics_url = metrics_url
        self.pid = pid  # the server's process, when started here (its cores per level)

    @classmethod
    def of(cls, server: Server) -> Target:
        pid = server.proc.pid if server.proc is not None else None
        return cls(server.url, server.model, server.metrics_url, pid)

    def queue_totals(self) -> tuple[float, float] | None:
        """(sum, count) of kvflow_admission_queue_seconds, or None without metrics."""
        if self.metrics_url is None:
            return None
        found = scrape(self.metrics_url, (QUEUE + "_sum", QUEUE + "_count"))
        return found.get(QUEUE + "_sum", 0.0), found.get(QUEUE + "_count", 0.0)


QUEUE = "kvflow_admission_queue_seconds"


async def closed_loop(
    target: Target,
    texts: list[list[str]],
    max_tokens: int,
    name: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Level:
    """One client per list in ``texts``, each sending its prompts one after the other."""
    import aiohttp

    level = Level(name or f"closed_c{len(texts)}")
    before = target.queue_totals()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(mine: list[str]) -> None:
            for text in mine:
                outcome = await one_request(
                    session, target.url, target.model, text, max_tokens, extra
                )
                level.outcomes.append(outcome)
                if outcome.status == "200":
                    level.outputs[text] = outcome.text

        start = time.perf_counter()
        await asyncio.gather(*(client(t) for t in texts))
        level.wall_s = time.perf_counter() - start
    level.queue_s = _queue_mean(before, target.queue_totals())
    return level


async def open_loop(
    target: Target,
    texts: list[str],
    gaps: list[float],
    max_tokens: int,
    name: str,
    extra: dict[str, Any] | None = None,
) -> Level:
    """Each of ``texts`` sent ``gaps`` seconds after the one before (the first: after the
    start), with ``extra`` body fields."""
    import aiohttp

    level = Level(name)
    before = target.queue_totals()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        due = start
        for gap, text in zip(gaps, texts, strict=True):
            due += gap
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(
                asyncio.create_task(
                    one_request(session, target.url, target.model, text, max_tokens, extra)
                )
            )
        level.outcomes = list(await asyncio.gather(*tasks))
        level.wall_s = time.perf_counter() - start
    level.queue_s = _queue_mean(before, target.queue_totals())
    return level


def sampling_body(temperature: float | None) -> dict[str, Any] | None:
    """The body fields every request carries: the temperature where one is given (None: no
    field, each server's default)."""
    return None if temperature is None else {"temperature": temperature}


def _queue_mean(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float:
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return (after[0] - before[0]) / (after[1] - before[1])


def _against_other(
    args: argparse.Namespace, log_dir: Path, capacity: float | None
) -> dict[str, Level]:
    """Every level against ``--compare-url`` (started and stopped here with ``--compare-cmd``)."""
    return against_other(
        args, log_dir, lambda server: asyncio.run(run(args, Target.of(server), capacity))
    )


def _capacity(levels: dict[str, Level]) -> float:
    """Requests served per second by the closed loop at its highest concurrency."""
    closed = [k for k in levels if k.startswith("closed_c")]
    top = max(closed, key=lambda k: int(k.split("_c")[1]))
    return max(levels[top].summary()["goodput_rps"], 1e-3)


@dataclass
class Plan:
    """One level's requests, drawn before it runs: a closed level's prompts, one list per
    client, or an open level's prompts and the gaps between their arrivals (``rate`` per
    second)."""

    name: str
    clients: list[list[str]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    rate: float = 0.0


def _numbers(text: str, kind: type[int] | type[float]) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


def closed_plans(args: argparse.Namespace, prompts: Prompts) -> tuple[list[list[str]], list[Plan]]:
    """The warm-up's prompts (two clients of two) and the closed levels' plans."""
    warm = [prompts.take(2) for _ in range(2)]
    plans = [
        Plan(f"closed_c{c}", clients=[prompts.take(args.requests_per_client) for _ in range(c)])
        for c in _numbers(args.concurrency, int)
    ]
    return warm, plans


def open_plans(args: argparse.Namespace, prompts: Prompts, capacity: float) -> list[Plan]:
    """The open levels' plans: ``--open-requests`` prompts each, arriving as a Poisson process
    at its multiple of ``capacity``; drawn after the closed levels' (the same seed, the same
    prompts and arrivals against every server)."""
    plans = []
    for mult in _numbers(args.rates, float):
        texts = prompts.take(args.open_requests)
        rate = mult * capacity
        gaps = [prompts.rng.expovariate(rate) for _ in texts]
        plans.append(Plan(f"open_{mult:g}x", texts=texts, gaps=gaps, rate=rate))
    return plans


async def measure(args: argparse.Namespace, target: Target, plan: Plan) -> Level:
    """One level against ``target``, with the cores used meanwhile."""
    meter = CoreMeter(target.pid)
    extra = sampling_body(args.temperature)
    meter.start()
    if plan.gaps:
        level = await open_loop(target, plan.texts, plan.gaps, args.max_tokens, plan.name, extra)
    else:
        level = await closed_loop(target, plan.clients, args.max_tokens, plan.name, extra)
    level.cores = meter.stop()
    rate = f" ({plan.rate:.2f} req/s)" if plan.gaps else ""
    logger.warning("%s%s: %s", plan.name, rate, _short(level.summary()))
    return level


async def run(args: argparse.Namespace, target: Target, capacity: float | None) -> dict[str, Level]:
    """Every level against ``target``; the open loop's rates are multiples of ``capacity``
    (None: measured here by the closed loop)."""
    prompts = Prompts(args.seed, args.prompt_words, args.shared_prefix_words)
    warm, closed = closed_plans(args, prompts)
    await closed_loop(target, warm, args.max_tokens, extra=sampling_body(args.temperature))
    levels = {plan.name: await measure(args, target, plan) for plan in closed}
    if levels:
        capacity = capacity if capacity is not None else _capacity(levels)
        for plan in open_plans(args, prompts, capacity):
            levels[plan.name] = await measure(args, target, plan)
    return levels


def _interleaved(
    args: argparse.Namespace, model: Path, where: Path
) -> tuple[dict[str, Level], dict[str, Level], list[dict[str, Any]]]:
    """kvflow's server and the other one up at once (kvflow started first), both warmed,
    then each level run on one and then on the other, kvflow first in the first level and
    the order swapped in every next one (A B, B A, ...), so that a change in the machine's
    pace lands on both; each turn first waits for quiet cores (``--quiet-s``: a server may
    keep the cores busy a while after its last answer). The open levels' rates are multiples
    of kvflow's capacity. Returns kvflow's levels, the other's and the turns taken."""
    server = start_embedded(model, where / "server", args.server_args.split())
    try:
        return against_other(
            args, where / "compare", lambda other: _turns(args, Target.of(server), Target.of(other))
        )
    finally:
        stop_embedded(server.proc)


def _turns(
    args: argparse.Namespace, kvflow: Target, other: Target
) -> tuple[dict[str, Level], dict[str, Level], list[dict[str, Any]]]:
    prompts = Prompts(args.seed, args.prompt_words, args.shared_prefix_words)
    warm, closed = closed_plans(args, prompts)
    targets = {"kvflow": kvflow, "compare": other}
    extra = sampling_body(args.temperature)
    for target in targets.values():
        asyncio.run(closed_loop(target, warm, args.max_tokens, extra=extra))
    levels: dict[str, dict[str, Level]] = {"kvflow": {}, "compare": {}}
    turns: list[dict[str, Any]] = []

    def play(plans: list[Plan]) -> None:
        for plan in plans:
            done = len(levels["kvflow"])  # levels played so far: even, kvflow first
            order = ("kvflow", "compare") if done % 2 == 0 else ("compare", "kvflow")
            for who in order:
                quiet = wait_quiet(args.quiet_s)
                turns.append({"level": plan.name, "server": who, "at": time.time(),
                              "quiet_s": round(quiet, 2)})  # fmt: skip
                levels[who][plan.name] = asyncio.run(measure(args, targets[who], plan))

    play(closed)
    if levels["kvflow"]:
        play(open_plans(args, prompts, _capacity(levels["kvflow"])))
    return levels["kvflow"], levels["compare"], turns


def _against(
    args: argparse.Namespace, model: Path, data_dir: Path, python: str, capacity: float | None
) -> dict[str, Level]:
    """Every level against a fresh ``kvflow serve`` run by ``python``, stopped after."""
    server = start_embedded(model, data_dir, args.server_args.split(), python)
    try:
        return asyncio.run(run(args, Target.of(server), capacity))
    finally:
        stop_embedded(server.proc)


def _short(s: dict[str, Any]) -> str:
    refused = ",".join(f"{k}:{v}" for k, v in sorted(s["refused"].items())) or "none"
    if s["conn_errors"]:  # what the connection errors were
        refused += " (" + "; ".join(f"{n} x {e}" for e, n in sorted(s["conn_errors"].items())) + ")"
    return (
        f"{s['served']}/{s['requests']} served, 5xx {s['http_5xx']}, refused {refused}, "
        f"goodput {s['goodput_rps']:.2f} req/s {s['goodput_tokens_per_s']:.1f} tok/s, "
        f"ttft p50/p99 {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms, "
        f"tpot p50/p99 {s['tpot_p50_ms']:.1f}/{s['tpot_p99_ms']:.1f} ms, "
        f"queue {s['queue_mean_ms']:.0f} ms" + _cores_text(s["cores"])
    )


def _cores_text(cores: dict[str, float] | None) -> str:
    """The level's cores: the server's, the clients' and the other processes' (host's)."""
    if cores is None:
        return ""
    names = ("server", "client", "others") if "server" in cores else ("host", "client")
    text = ", cores " + " ".join(f"{n} {cores[n]:.2f}" for n in names)
    if disturbed(cores):
        text += f", DISTURBED (other processes used {cores['others']:.2f} cores)"
    return text


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--url", help="a running server's HTTP URL (default: start kvflow serve)")
    p.add_argument("--metrics-url", help="with --url: its Prometheus URL (for queue time)")
    p.add_argument("--model-name", help="with --url: the served model's name")
    p.add_argument(
        "--model",
        help="the model directory to serve, or `default` (SmolLM2-135M-Instruct, imported "
        "into a temporary directory); default: the tiny demo model",
    )
    p.add_argument(
        "--baseline-python",
        help="also run the same levels, same seed, against `kvflow serve` run by this "
        "interpreter (e.g. another checkout's .venv/bin/python), for a comparison",
    )
    add_compare_arguments(p)
    p.add_argument("--server-args", default="", help="more `kvflow serve` flags, one string")
    p.add_argument("--concurrency", default="1,8,32,64,128", help="closed-loop clients")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--rates", default="0.5,1,2,4", help="open loop: multiples of capacity")
    p.add_argument("--open-requests", type=int, default=128, help="requests per open level")
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument(
        "--shared-prefix-words",
        type=int,
        default=0,
        help="every prompt starts with the same seeded words (a shared system prompt), this "
        "many, before its own --prompt-words",
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument(
        "--temperature",
        type=float,
        help="send this temperature with every request (default: none, so each server "
        "samples at its own default: kvflow greedily unless the model's "
        "generation_config.json names one, vLLM at 1.0); 0 makes both greedy",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="with --compare-url: both servers up at once, each level run on one and then on "
        "the other, the order swapped from level to level (default: kvflow's every level, "
        "then the other server's)",
    )
    p.add_argument(
        "--quiet-s",
        type=float,
        default=10.0,
        help="interleaved: before each server's level, wait up to this long for the host's "
        f"cores to be quiet (under {QUIET_BUSY * 100:.0f}%% busy over half a second); 0: no wait",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=run_bench)
    return p


register, main = _cli.entry_points("bench-load", __doc__, add_arguments)


def _counts_wrong(args: argparse.Namespace) -> str | None:
    """What is wrong with the level flags, decided before any server starts (None: nothing)."""
    for flag, text, kind in (
        ("--concurrency", args.concurrency, int),
        ("--rates", args.rates, float),
    ):
        for item in (x.strip() for x in text.split(",") if x.strip()):
            try:
                value = kind(item)
            except ValueError:
                return f"{flag} takes comma-separated numbers, not {item!r}"
            if not value > 0:  # also refuses nan
                return f"{flag} values must be above 0, not {item}"
    for flag, count in (
        ("--requests-per-client", args.requests_per_client),
        ("--open-requests", args.open_requests),
        ("--max-tokens", args.max_tokens),
    ):
        if count < 1:
            return f"{flag} must be at least 1, not {count}"
    if not args.quiet_s >= 0:  # also refuses nan
        return f"--quiet-s must be 0 or more seconds, not {args.quiet_s:g}"
    return None


def run_bench(args: argparse.Namespace) -> int:
    if args.url and not args.model_name:
        print("bench-load: --url needs --model-name", file=sys.stderr)
        return 2
    if _cli.compare_flags_wrong("bench-load", args):
        return 2
    wrong = _counts_wrong(args)
    if wrong:
        print(f"bench-load: {wrong}", file=sys.stderr)
        return 2
    if args.interleave and (not args.compare_url or args.url or args.baseline_python):
        print(
            "bench-load: --interleave takes turns between the kvflow server started here and "
            "--compare-url's: it needs --compare-url, and takes neither --url nor "
            "--baseline-python",
            file=sys.stderr,
        )
        return 2
    if args.temperature is not None and not 0.0 <= args.temperature <= MAX_TEMPERATURE:
        print(
            f"bench-load: --temperature must be in [0, {MAX_TEMPERATURE:g}] (the OpenAI API's "
            f"range), got {args.temperature:g}",
            file=sys.stderr,
        )
        return 2
    if args.baseline_python:  # absolute, not resolved: a venv's python is a symlink
        args.baseline_python = os.path.abspath(args.baseline_python)
    baseline: dict[str, Level] = {}
    compare: dict[str, Level] = {}
    compare_error = None
    checkouts: dict[str, str] = {}
    turns: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.interleave:
            model = model_dir(args.model, Path(tmp), args.seed)
            served = f"kvflow serve --model {model.name} {args.server_args}".strip()
            checkouts["server"] = checkout(sys.executable, Path(tmp))
            try:
                levels, compare, turns = _interleaved(args, model, Path(tmp))
            except RuntimeError as e:  # the other server did not start: nothing was measured
                levels = {}
                compare_error = f"{e}: {log_tail(Path(tmp) / 'compare' / 'compare.log')}"
                print(f"bench-load: compare: {compare_error}", file=sys.stderr)
        elif args.url:
            target = Target(args.url, args.model_name, args.metrics_url)
            served = args.url
            levels = asyncio.run(run(args, target, None))
        else:
            model = model_dir(args.model, Path(tmp), args.seed)
            served = f"kvflow serve --model {model.name} {args.server_args}".strip()
            checkouts["server"] = checkout(sys.executable, Path(tmp))
            levels = _against(args, model, Path(tmp) / "server", sys.executable, None)
            if args.baseline_python:  # the same arrival rates, for a like-for-like comparison
                checkouts["baseline"] = checkout(args.baseline_python, Path(tmp))
                baseline = _against(
                    args, model, Path(tmp) / "baseline", args.baseline_python, _capacity(levels)
                )
        if args.compare_url and not args.interleave:  # the same prompts and rates there
            capacity = _capacity(levels) if levels else None
            try:
                compare = _against_other(args, Path(tmp) / "compare", capacity)
            except RuntimeError as e:  # kvflow's numbers are still reported
                compare_error = f"{e}: {log_tail(Path(tmp) / 'compare' / 'compare.log')}"
                print(f"bench-load: compare: {compare_error}", file=sys.stderr)
    summaries = {name: level.summary() for name, level in levels.items()}
    load = os.getloadavg()
    doc = {
        "bench": "load",
        "server": served,
        "prompt_words": args.prompt_words,
        "shared_prefix_words": args.shared_prefix_words,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "requests_per_client": args.requests_per_client,
        "open_requests": args.open_requests,
        "seed": args.seed,
        "results": summaries,
        "baseline_python": args.baseline_python,
        "checkouts": checkouts,
        "baseline": {name: level.summary() for name, level in baseline.items()},
        "compare_url": args.compare_url,
        "compare_cmd": args.compare_cmd,
        "compare": {name: level.summary() for name, level in compare.items()},
        "compare_error": compare_error,
        "interleave": args.interleave,
        "turns": turns,  # interleaved: each server's turn at each level, in order
        "load_avg": load,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    shared = f"{args.shared_prefix_words} shared + " if args.shared_prefix_words else ""
    served_all = sum(s["served"] for s in summaries.values())
    total = sum(s["requests"] for s in summaries.values())
    five = sum(s["http_5xx"] for s in summaries.values())
    parts = [f"{name}: {_short(s)}" for name, s in summaries.items()]
    parts += [f"baseline {name}: {_short(s)}" for name, s in doc["baseline"].items()]
    parts += [f"compare {name}: {_short(s)}" for name, s in doc["compare"].items()]
    beside = [
        f"{who}{name}"
        for who, levels in (("", summaries), ("baseline ", doc["baseline"]),
                            ("compare ", doc["compare"]))
        for name, s in levels.items()
        if s["disturbed"]
    ]  # fmt: skip
    if beside:
        parts.append(f"DISTURBED by other processes: {', '.join(beside)}")
    print(
        f"bench load ({served}; {shared}{args.prompt_words} words + {args.max_tokens} tokens): "
        f"{served_all}/{total} served, {five} 5xx; "
        + "; ".join(parts)
        + (f"; compare failed: {compare_error}" if compare_error else "")
        + f"; load avg {load[0]:.2f}",
        flush=True,
    )
    return 1 if compare_error else 0


if __name__ == "__main__":
    raise SystemExit(main())
