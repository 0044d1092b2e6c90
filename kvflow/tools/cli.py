"""The `kvflow` command line: one entry point, one module per subcommand.

Each module in COMMANDS exposes ``register(subparsers)``, which adds its subcommand with
``set_defaults(func=...)``; ``func(args) -> int`` is the exit code. Only the module of the
command being run is imported (``kvflow --help`` and the client commands never import torch):
the others appear in the help with their one-line summary.

A user's mistake is one line on stderr naming what is wrong, exit status 2: a bad flag
(``CliParser.error``) or a value the command refuses (a ValueError or OSError out of
``func``; ``--log-level DEBUG`` adds the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvflow import __version__

# command -> (module, one-line help shown by `kvflow --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo-model": ("kvflow.tools.demo_model", "write a seeded random-weight demo model"),
    "model": ("kvflow.tools.model_cmd", "import a GGUF model; the default model"),
    "serve": ("kvflow.tools.serve", "run kvflow (embedded, or one role of a cluster)"),
    "generate": ("kvflow.tools.generate", "send a prompt to a kvflow server"),
    "trace": ("kvflow.tools.trace", "export or summarise stage traces"),
    "profile": ("kvflow.tools.profile", "fit the conductor's prefill/decode time models"),
    "cluster": ("kvflow.tools.cluster", "start and supervise a local multi-process cluster"),
    "replay": ("kvflow.tools.replay", "replay a request trace through the router simulator"),
    "bench-metadata": ("kvflow.tools.bench.metadata", "metadata registration throughput"),
    "bench-transfer": ("kvflow.tools.bench.transfer", "transfer engine throughput"),
    "bench-http": ("kvflow.tools.bench.http", "HTTP streaming vs gRPC: TTFT and TPOT"),
    "bench-load": ("kvflow.tools.bench.load", "many HTTP clients: goodput, TTFT, refusals"),
    "bench-side": (
        "kvflow.tools.bench.side",
        "kvflow beside another OpenAI server: TTFT, decode, load",
    ),
    "kvdb": ("kvflow.tools.kvadmin", "inspect and manage a server's kvdb (admin service)"),
    "warmup": (
        "kvflow.tools.warmup",
        "offline cache warm-up jobs: submit, status, list, cancel, report",
    ),
}


class CliParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvflow serve: argument --port: invalid int value:
    'x'`` instead of the usage block (``--help`` still shows it). Subparsers are of this
    class too (argparse makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` (or every command when None) gets its full arguments."""
    parser = CliParser(prog="kvflow", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvflow {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, summary) in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(module).register(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one), if any."""
    return next((a for a in argv if a in COMMANDS), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    parser = build_parser(command) if command is not None else build_parser("")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:  # a value or a file the user gave, refused
        logging.getLogger("kvflow.cli").debug("kvflow %s failed", args.command, exc_info=True)
        print(f"kvflow {args.command}: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    """The exception's message on one line (its type when it has none)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
