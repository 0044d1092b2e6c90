"""The servers an HTTP benchmark drives: ``kvflow serve`` started in a process of its own, or
any other OpenAI-compatible server started by a command line; waiting for them, stopping them,
and what a benchmark records about them (the checkout, a log's tail, Prometheus counters)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Server:
    """A started server: its process (None when it was already running), HTTP URL, served
    model name, Prometheus URL (None when unknown) and log file."""

    proc: Any
    url: str
    model: str
    metrics_url: str | None
    log: Path | None
    started_at: float = 0.0  # time.perf_counter() just before its process started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_dir(given: str | None, tmp: Path, seed: int) -> Path:
    """``given`` as a path, ``default`` for SmolLM2-135M-Instruct imported into ``tmp``, or
    (None) the tiny demo model written there."""
    if given == "default":
        from kvflow.stages.engine.default_model import ensure_default_model

        return ensure_default_model(tmp / "models")
    if given:
        return Path(given)
    from kvflow.stages.engine import write_demo_model

    return write_demo_model(tmp / "tiny", preset="tiny", seed=seed)


def start_embedded(
    model: Path, data_dir: Path, extra: list[str], python: str = sys.executable
) -> Server:
    """``kvflow serve`` (embedded) run by ``python`` in a process of its own, on free ports;
    returns once /health answers, with the served model's name."""
    data_dir.mkdir(parents=True, exist_ok=True)
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [
        python, "-m", "kvflow.tools.cli", "serve", "--model", str(model),
        "--data-dir", str(data_dir), "--port", str(grpc_port), "--http-port", str(http_port),
        "--metrics-port", str(metrics_port), *extra,
    ]  # fmt: skip
    log = data_dir / "server.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        # cwd: the data dir, so `-m kvflow` imports the interpreter's own install (its
        # checkout), not a kvflow package that happens to sit in the caller's directory
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=data_dir)
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_healthy(url, proc, 600, log)
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())
    except BaseException:
        stop_embedded(proc)
        raise
    name = models["data"][0]["id"]
    return Server(proc, url, name, f"http://127.0.0.1:{metrics_port}/metrics", log, started)


def stop_embedded(proc: Any) -> None:
    """SIGTERM ``kvflow serve``; SIGKILL it if it has not exited after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_command(command: str, url: str, model: str, log_dir: Path, deadline_s: float) -> Server:
    """Run ``command`` (one shell-quoted string) in a process group of its own, its output in
    ``log_dir``/compare.log; returns once ``url``/health answers. Raises RuntimeError, naming
    the log, when it exits first or the deadline passes (the group is then stopped)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "compare.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            shlex.split(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_healthy(url.rstrip("/"), proc, deadline_s, log)
    except BaseException:
        stop_group(proc)
        raise
    return Server(proc, url.rstrip("/"), model, None, log, started)


def against_other(args: argparse.Namespace, log_dir: Path, measure: Callable[[Server], T]) -> T:
    """``measure`` against the server at ``--compare-url``; with ``--compare-cmd``, that server
    is started here first (its own process group, log in ``log_dir``) and stopped after."""
    if not args.compare_cmd:
        url = args.compare_url.rstrip("/")
        wait_healthy(url, None, args.compare_start_s, None)
        return measure(Server(None, url, args.compare_model_name, None, None))
    server = start_command(
        args.compare_cmd, args.compare_url, args.compare_model_name, log_dir, args.compare_start_s
    )
    try:
        return measure(server)
    finally:
        stop_group(server.proc)


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


def stop_group(proc: Any) -> None:
    """SIGTERM the process group ``proc`` leads, then SIGKILL it if still there after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        proc.wait(10)


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a log, or '' when there is none."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def checkout(python: str, cwd: Path) -> str:
    """Where ``python`` imports kvflow from, and that checkout's commit."""
    code = "import kvflow, os; print(os.path.dirname(os.path.dirname(kvflow.__file__)))"
    out = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True)
    root = out.stdout.strip()
    head = subprocess.run(
        ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return f"{root}@{head.stdout.strip() or '?'}"


def scrape(metrics_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sum over labels of each Prometheus sample named in ``names`` (absent: left out)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that name another OpenAI-compatible server to run the same load against."""
    p.add_argument(
        "--compare-url",
        help="after kvflow's server stopped (--interleave: beside it, taking turns), the same "
        "requests (same seed and prompts) against this other OpenAI-compatible server, e.g. "
        "vLLM on the same weights",
    )
    p.add_argument("--compare-model-name", help="with --compare-url: its served model's name")
    p.add_argument(
        "--compare-cmd",
        help="with --compare-url: the command that starts that server (one string); it is "
        "started after kvflow's server stopped (--interleave: after it started) and stopped "
        "at the end",
    )
    p.add_argument("--compare-start-s", type=float, default=900, help="its start-up deadline")


def compare_flags_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the compare flags, or None."""
    if args.compare_url and not args.compare_model_name:
        return "--compare-url needs --compare-model-name"
    if args.compare_cmd and not args.compare_url:
        return "--compare-cmd needs --compare-url"
    return None
