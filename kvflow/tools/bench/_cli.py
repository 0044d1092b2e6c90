"""The command-line wiring of a benchmark module: its ``kvflow`` subcommand, its own ``main``
(``python -m``), the check of the flags that name a server to compare against, and flags that
take a comma-separated list of known names."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterable
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


def names_of(what: str, allowed: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse ``type``: comma-separated names, each one of ``allowed``; its error names
    the unknown ones, as ``what`` (e.g. ``dtype``) says what they are."""
    known = list(allowed)

    def names(value: str) -> list[str]:
        got = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in got if n not in known]
        if not got or bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s) {bad or value!r}; one or more of {known}"
            )
        return got

    return names
