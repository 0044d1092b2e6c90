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
status (or ``conn`` for a connection error). Without ``--url`` it starts ``kvflow serve``
(the embedded server) in a process of its own on free ports, with ``--model`` (default: the
tiny demo model) and stops it at the end.

``--compare-url`` then runs the same levels, same seed and prompts, against any other
OpenAI-compatible server (e.g. vLLM serving the same weights), after kvflow's server has
stopped; with ``--compare-cmd`` the benchmark starts that server itself, waits for its
``/health``, and stops it after, so only one server runs at a time.

Seeded (prompts, arrivals); prints one summary line; ``--json PATH`` writes every number.

    python -m kvflow.tools.bench.load --concurrency 1,8,64 --rates 0.5,1,2,4
    python -m kvflow.tools.bench.load --url http://127.0.0.1:8000 --metrics-url \\
        http://127.0.0.1:9464/metrics --model-name SmolLM2-135M-Instruct
    python -m kvflow.tools.bench.load --model DIR --compare-url http://127.0.0.1:8011 \\
        --compare-cmd "vllm serve DIR --port 8011" --compare-model-name DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WORDS = ["kv", "cache", "prefix", "block", "token", "store", "tier", "moon"]
WORDS += ["cake", "flow", "page", "decode", "prefill", "route"]


@dataclass
class Outcome:
    """One request: ``status`` 200 when served (``ttft_s``, ``tpot_s`` set), else its HTTP
    status or ``conn``."""

    status: str
    ttft_s: float = 0.0
    tpot_s: float | None = None
    tokens: int = 0


@dataclass
class Level:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    queue_s: float = 0.0  # mean admission wait (server side), when scraped

    def summary(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.status == "200"]
        refused: dict[str, int] = {}
        for o in self.outcomes:
            if o.status != "200":
                refused[o.status] = refused.get(o.status, 0) + 1
        ttft = [o.ttft_s * 1000 for o in ok]
        tpot = [o.tpot_s * 1000 for o in ok if o.tpot_s is not None]
        wall = max(self.wall_s, 1e-9)
        return {
            "requests": len(self.outcomes),
            "served": len(ok),
            "refused": refused,
            "http_5xx": sum(n for s, n in refused.items() if s.startswith("5")),
            "goodput_rps": len(ok) / wall,
            "goodput_tokens_per_s": sum(o.tokens for o in ok) / wall,
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99),
            "queue_mean_ms": self.queue_s * 1000,
            "wall_s": self.wall_s,
        }


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one_request(session: Any, url: str, model: str, text: str, max_tokens: int) -> Outcome:
    import aiohttp

    body = {
        "model": model,
        "prompt": text,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return Outcome(str(resp.status))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    arrivals.append(time.perf_counter())
                if "error" in event:
                    return Outcome(f"stream-{event['error'].get('code', 'error')}")
    except (TimeoutError, aiohttp.ClientError, OSError):
        return Outcome("conn")
    if not arrivals:
        return Outcome("empty")
    tpot = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None
    return Outcome("200", arrivals[0] - start, tpot, tokens or len(arrivals))


class Target:
    """The server's HTTP URL, its model name and (optionally) its metrics URL."""

    def __init__(self, url: str, model: str, metrics_url: str | None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.metrics_url = metrics_url

    def queue_totals(self) -> tuple[float, float] | None:
        """(sum, count) of kvflow_admission_queue_seconds, or None without metrics."""
        if self.metrics_url is None:
            return None
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith("kvflow_admission_queue_seconds_sum "):
                total = float(line.split()[1])
            elif line.startswith("kvflow_admission_queue_seconds_count "):
                count = float(line.split()[1])
        return total, count


async def closed_loop(
    target: Target, clients: int, per_client: int, max_tokens: int, rng: random.Random, words: int
) -> Level:
    import aiohttp

    texts = [[prompt(rng, words) for _ in range(per_client)] for _ in range(clients)]
    level = Level(f"closed_c{clients}")
    before = target.queue_totals()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client(mine: list[str]) -> None:
            for text in mine:
                level.outcomes.append(
                    await one_request(session, target.url, target.model, text, max_tokens)
                )

        start = time.perf_counter()
        await asyncio.gather(*(client(t) for t in texts))
        level.wall_s = time.perf_counter() - start
    level.queue_s = _queue_mean(before, target.queue_totals())
    return level


async def open_loop(
    target: Target, rate: float, n: int, max_tokens: int, rng: random.Random, words: int, name: str
) -> Level:
    import aiohttp

    gaps = [rng.expovariate(rate) for _ in range(n)]
    texts = [prompt(rng, words) for _ in range(n)]
    level = Level(name)
    before = target.queue_totals()
    connector = aiohttp.TCPConnector(limit=0)
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
                    one_request(session, target.url, target.model, text, max_tokens)
                )
            )
        level.outcomes = list(await asyncio.gather(*tasks))
        level.wall_s = time.perf_counter() - start
    level.queue_s = _queue_mean(before, target.queue_totals())
    return level


def _queue_mean(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float:
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return (after[0] - before[0]) / (after[1] - before[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_embedded(
    model: Path, data_dir: Path, extra: list[str], python: str = sys.executable
) -> tuple[Any, Target]:
    """``kvflow serve`` (embedded) run by ``python`` in a process of its own; returns once
    /health answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    grpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    cmd = [
        python, "-m", "kvflow.tools.cli", "serve", "--model", str(model),
        "--data-dir", str(data_dir), "--port", str(grpc_port), "--http-port", str(http_port),
        "--metrics-port", str(metrics_port), *extra,
    ]  # fmt: skip
    log = open(data_dir / "server.log", "wb")  # noqa: SIM115 - closed with the process
    # cwd: the data dir, so `-m kvflow` imports the interpreter's own install (its checkout),
    # not a kvflow package that happens to sit in the caller's working directory
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=data_dir)
    url = f"http://127.0.0.1:{http_port}"
    wait_healthy(url, proc, 600, data_dir / "server.log")
    models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
    name = models["data"][0]["id"]
    return proc, Target(url, name, f"http://127.0.0.1:{metrics_port}/metrics")


def wait_healthy(url: str, proc: Any, deadline_s: float, log: Path | None) -> None:
    """Returns once ``url``/health answers; raises if ``proc`` (may be None) exits first or
    the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                if proc is not None and proc.poll() is None:
                    proc.kill()
                where = f"; see {log}" if log else ""
                raise RuntimeError(f"the server at {url} did not start{where}") from None
            time.sleep(0.5)


def _against_other(
    args: argparse.Namespace, log_dir: Path, capacity: float | None
) -> dict[str, Level]:
    """Every level against ``--compare-url``; with ``--compare-cmd``, that server is started
    here first (its own process group, log in ``log_dir``) and stopped after."""
    url = args.compare_url.rstrip("/")
    proc = None
    if args.compare_cmd:
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / "compare.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            shlex.split(args.compare_cmd), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_healthy(url, proc, args.compare_start_s, log_dir / "compare.log" if proc else None)
        target = Target(url, args.compare_model_name, None)
        return asyncio.run(run(args, target, capacity))
    finally:
        if proc is not None:
            _stop_group(proc)


def _log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a log, or '' when there is none."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def _stop_group(proc: Any) -> None:
    """SIGTERM the process group ``proc`` leads, then SIGKILL it if still there after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        proc.wait(10)


def _checkout(python: str, cwd: Path) -> str:
    """Where ``python`` imports kvflow from, and that checkout's commit."""
    code = "import kvflow, os; print(os.path.dirname(os.path.dirname(kvflow.__file__)))"
    out = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True)
    root = out.stdout.strip()
    head = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return f"{root}@{head.stdout.strip() or '?'}"


def _capacity(levels: dict[str, Level]) -> float:
    """Requests served per second by the closed loop at its highest concurrency."""
    closed = [k for k in levels if k.startswith("closed_c")]
    top = max(closed, key=lambda k: int(k.split("_c")[1]))
    return max(levels[top].summary()["goodput_rps"], 1e-3)


async def run(args: argparse.Namespace, target: Target, capacity: float | None) -> dict[str, Level]:
    """Every level against ``target``; the open loop's rates are multiples of ``capacity``
    (None: measured here by the closed loop)."""
    rng = random.Random(args.seed)
    levels: dict[str, Level] = {}
    await closed_loop(target, 2, 2, args.max_tokens, rng, args.prompt_words)  # warm-up
    for c in [int(x) for x in args.concurrency.split(",") if x]:
        level = await closed_loop(
            target, c, args.requests_per_client, args.max_tokens, rng, args.prompt_words
        )
        levels[level.name] = level
        logger.warning("%s: %s", level.name, _short(level.summary()))
    rates = [float(x) for x in args.rates.split(",") if x]
    if rates and levels:
        capacity = capacity if capacity is not None else _capacity(levels)
        for mult in rates:
            name = f"open_{mult:g}x"
            level = await open_loop(
                target, mult * capacity, args.open_requests, args.max_tokens, rng,
                args.prompt_words, name,
            )  # fmt: skip
            levels[name] = level
            logger.warning("%s (%.2f req/s): %s", name, mult * capacity, _short(level.summary()))
    return levels


def _model(given: str | None, tmp: Path, seed: int) -> Path:
    if given == "default":
        from kvflow.stages.engine.default_model import ensure_default_model

        return ensure_default_model(tmp / "models")
    if given:
        return Path(given)
    from kvflow.stages.engine import write_demo_model

    return write_demo_model(tmp / "tiny", preset="tiny", seed=seed)


def _against(
    args: argparse.Namespace, model: Path, data_dir: Path, python: str, capacity: float | None
) -> dict[str, Level]:
    """Every level against a fresh ``kvflow serve`` run by ``python``, stopped after."""
    proc, target = start_embedded(model, data_dir, args.server_args.split(), python)
    try:
        return asyncio.run(run(args, target, capacity))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _short(s: dict[str, Any]) -> str:
    refused = ",".join(f"{k}:{v}" for k, v in sorted(s["refused"].items())) or "none"
    return (
        f"{s['served']}/{s['requests']} served, 5xx {s['http_5xx']}, refused {refused}, "
        f"goodput {s['goodput_rps']:.2f} req/s {s['goodput_tokens_per_s']:.1f} tok/s, "
        f"ttft p50/p99 {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms, "
        f"tpot p50/p99 {s['tpot_p50_ms']:.1f}/{s['tpot_p99_ms']:.1f} ms, "
        f"queue {s['queue_mean_ms']:.0f} ms"
    )


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
    p.add_argument(
        "--compare-url",
        help="after kvflow's levels, run the same levels (same seed, prompts and open-loop "
        "rates) against this other OpenAI-compatible server, e.g. vLLM on the same weights",
    )
    p.add_argument("--compare-model-name", help="with --compare-url: its served model's name")
    p.add_argument(
        "--compare-cmd",
        help="with --compare-url: the command that starts that server (one string); it is "
        "started after kvflow's server stopped and stopped at the end",
    )
    p.add_argument("--compare-start-s", type=float, default=900, help="its start-up deadline")
    p.add_argument("--server-args", default="", help="more `kvflow serve` flags, one string")
    p.add_argument("--concurrency", default="1,8,32,64,128", help="closed-loop clients")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--rates", default="0.5,1,2,4", help="open loop: multiples of capacity")
    p.add_argument("--open-requests", type=int, default=128, help="requests per open level")
    p.add_argument("--prompt-words", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.set_defaults(func=run_bench)
    return p


def register(subparsers: Any) -> None:
    add_arguments(subparsers.add_parser("bench-load", help=__doc__.splitlines()[0]))


def main(argv: list[str] | None = None) -> int:
    p = add_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return run_bench(p.parse_args(argv))


def run_bench(args: argparse.Namespace) -> int:
    if args.url and not args.model_name:
        print("bench-load: --url needs --model-name", file=sys.stderr)
        return 2
    if args.compare_url and not args.compare_model_name:
        print("bench-load: --compare-url needs --compare-model-name", file=sys.stderr)
        return 2
    if args.compare_cmd and not args.compare_url:
        print("bench-load: --compare-cmd needs --compare-url", file=sys.stderr)
        return 2
    if args.baseline_python:  # absolute, not resolved: a venv's python is a symlink
        args.baseline_python = os.path.abspath(args.baseline_python)
    baseline: dict[str, Level] = {}
    compare: dict[str, Level] = {}
    compare_error = None
    checkouts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.url:
            target = Target(args.url, args.model_name, args.metrics_url)
            served = args.url
            levels = asyncio.run(run(args, target, None))
        else:
            model = _model(args.model, Path(tmp), args.seed)
            served = f"kvflow serve --model {model.name} {args.server_args}".strip()
            checkouts["server"] = _checkout(sys.executable, Path(tmp))
            levels = _against(args, model, Path(tmp) / "server", sys.executable, None)
            if args.baseline_python:  # the same arrival rates, for a like-for-like comparison
                checkouts["baseline"] = _checkout(args.baseline_python, Path(tmp))
                baseline = _against(
                    args, model, Path(tmp) / "baseline", args.baseline_python, _capacity(levels)
                )
        if args.compare_url:  # the same prompts and rates against the other server
            capacity = _capacity(levels) if levels else None
            try:
                compare = _against_other(args, Path(tmp) / "compare", capacity)
            except RuntimeError as e:  # kvflow's numbers are still reported
                compare_error = f"{e}: {_log_tail(Path(tmp) / 'compare' / 'compare.log')}"
                print(f"bench-load: compare: {compare_error}", file=sys.stderr)
    summaries = {name: level.summary() for name, level in levels.items()}
    load = os.getloadavg()
    doc = {
        "bench": "load",
        "server": served,
        "prompt_words": args.prompt_words,
        "max_tokens": args.max_tokens,
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
        "load_avg": load,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    served_all = sum(s["served"] for s in summaries.values())
    total = sum(s["requests"] for s in summaries.values())
    five = sum(s["http_5xx"] for s in summaries.values())
    parts = [f"{name}: {_short(s)}" for name, s in summaries.items()]
    parts += [f"baseline {name}: {_short(s)}" for name, s in doc["baseline"].items()]
    parts += [f"compare {name}: {_short(s)}" for name, s in doc["compare"].items()]
    print(
        f"bench load ({served}; {args.prompt_words} words + {args.max_tokens} tokens): "
        f"{served_all}/{total} served, {five} 5xx; "
        + "; ".join(parts)
        + (f"; compare failed: {compare_error}" if compare_error else "")
        + f"; load avg {load[0]:.2f}",
        flush=True,
    )
    return 1 if compare_error else 0


if __name__ == "__main__":
    raise SystemExit(main())
