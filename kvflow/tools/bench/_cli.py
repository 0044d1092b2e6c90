"""The command-line wiring of a benchmark module: its ``kvflow`` subcommand, its own ``main``
(``python -m``), and the check of the flags that name a server to compare against."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from kvflow.tools.bench._servers import compare_flags_error

AddArguments = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def entry_points(
    name: str, doc: str, add_arguments: AddArguments
) -> tuple[Callable[[Any], None], Callable[..., int]]:
    """A benchmark module's ``register(subparsers)``, which adds the subcommand ``name`` (its
    help the first line of ``doc``), and its ``main(argv=None)``, which parses ``argv``, logs
    warnings and runs the ``func`` that ``add_arguments`` sets."""

    def register(subparsers: Any) -> None:
        add_arguments(subparsers.add_parser(name, help=doc.splitlines()[0]))

    def main(argv: list[str] | None = None) -> int:
        p = add_arguments(argparse.ArgumentParser(description=doc.splitlines()[0]))
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        args = p.parse_args(argv)
        return int(args.func(args))

    return register, main


def compare_flags_wrong(prog: str, args: argparse.Namespace) -> bool:
    """Whether the compare flags are wrong; if so, says what on stderr as ``prog: ...``."""
    error = compare_flags_error(args)
    if error:
        print(f"{prog}: {error}", file=sys.stderr)
    return error is not None
