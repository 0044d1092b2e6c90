"""The `kvflow` command line: one entry point, one module per subcommand.

Each module listed in COMMAND_MODULES exposes ``register(subparsers)``, which adds its
subcommand(s) with ``set_defaults(func=...)``; ``func(args) -> int`` is the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "kvflow.tools.demo_model",
    "kvflow.tools.model_cmd",
    "kvflow.tools.serve",
    "kvflow.tools.generate",
    "kvflow.tools.trace_cmd",
    "kvflow.tools.profile",
    "kvflow.tools.cluster",
    "kvflow.tools.replay",
    "kvflow.tools.bench_metadata",
    "kvflow.tools.bench_transfer",
    "kvflow.tools.kvadmin",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
