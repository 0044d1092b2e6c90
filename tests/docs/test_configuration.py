"""docs/configuration.md is generated from the CLI's parsers (kvflow/tools/config_doc.py),
never edited by hand: this fails when the page differs from what the parsers say now."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.docs.blocks import DOCS, ROOT

pytestmark = pytest.mark.slow  # a fresh interpreter imports torch and every command


def test_configuration_reference_is_generated_from_the_parsers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvflow.tools.config_doc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert out.stdout == page, (
        "docs/configuration.md is stale: run "
        "`.venv/bin/python -m kvflow.tools.config_doc > docs/configuration.md`"
    )


def test_the_reference_has_every_command_and_the_new_flags() -> None:
    from kvflow.tools.cli import COMMANDS

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for command in COMMANDS:
        assert f"## `kvflow {command}`" in page
    for flag in ("`--port-base`", "`--api-key-file`", "`--num-pages`", "`--version`"):
        assert flag in page
