"""`kvflow --help` and the client commands never import torch (they answer in well under a
second): only the module of the command being run is imported."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvflow.tools.cli import COMMANDS, build_parser


def _imports_torch(code: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("command", ["", "generate", "kvdb", "trace", "cluster", "replay"])
def test_light_commands_do_not_import_torch(command: str) -> None:
    assert not _imports_torch(
        f"from kvflow.tools.cli import build_parser\nbuild_parser({command!r})"
    )


def test_help_lists_every_command_without_loading_them() -> None:
    parser = build_parser("")
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)  # type: ignore[attr-defined]


def test_serve_flags_are_light_and_the_check_sees_torch() -> None:
    serve = "from kvflow.tools.cli import build_parser\nbuild_parser('serve')"
    assert _imports_torch(serve) is False
    assert _imports_torch("import kvflow.stages.engine")


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and every subcommand's parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_commands_help_formats() -> None:
    """``--help`` of each command and subcommand renders (a stray ``%`` in a flag's help
    breaks argparse's formatting only when the help is shown)."""
    parsers = _parsers(build_parser(None))
    assert len(parsers) > len(COMMANDS)
    for parser in parsers:
        assert parser.prog in parser.format_help()
