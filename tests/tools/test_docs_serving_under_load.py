"""The command blocks of docs/serving-under-load.md, run as written: the queue flags parse into
the documented defaults, and the small load benchmark serves every request with no 5xx."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest

from kvflow.stages.serve.config import RoutingConfig
from kvflow.tools import cli
from kvflow.tools.serve import _routing, http_config
from tests.docs.blocks import ROOT, block

PAGE = ROOT / "docs" / "serving-under-load.md"


def argv_of(command: str) -> list[str]:
    words = shlex.split(command.replace("\\\n", " "))
    assert words[0] == "kvflow"
    return words[1:]


def test_queue_flags_are_the_defaults() -> None:
    argv = argv_of(block("serving-under-load.md", "serve-queue-flags"))
    args = cli.build_parser("serve").parse_args(argv)
    config = RoutingConfig(**_routing(args))
    defaults = cli.build_parser("serve").parse_args(["serve"])
    assert config == RoutingConfig(**_routing(defaults))  # the page shows the defaults
    assert config.max_queued_requests >= 256  # the floor for the default
    assert http_config(args) == http_config(defaults)


def test_documented_defaults_match_the_tables() -> None:
    """Every `--flag | default` row of the page's tables is the parser's default."""
    parser = cli.build_parser("serve")
    defaults = vars(parser.parse_args(["serve"]))
    rows = re.findall(r"^\| `--([a-z-]+)` \| ([0-9.]+) (MiB)?", PAGE.read_text(), re.M)
    assert len(rows) >= 8
    for flag, value, mib in rows:
        want = float(value) * (1 << 20 if mib else 1)
        assert float(defaults[flag.replace("-", "_")]) == want, flag


@pytest.mark.slow
def test_small_load_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = argv_of(block("serving-under-load.md", "bench-load-small"))
    out = tmp_path / "load.json"
    assert cli.main([*argv, "--json", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("bench load") and " 0 5xx" in line
    doc = json.loads(out.read_text())
    for level in doc["results"].values():
        assert level["served"] == level["requests"] and level["http_5xx"] == 0
        if Path("/proc/stat").is_file():  # who used the cores: the server it started, ...
            assert set(level["cores"]) == {"host", "server", "client", "others"}
            assert level["cores"]["server"] > 0
    assert set(doc["results"]) == {"closed_c1", "closed_c8", "open_1x"}
    assert ", cores server " in line


def test_config_fields_are_flags() -> None:
    """The queue's config fields all come from `kvflow serve` flags."""
    args = cli.build_parser("serve").parse_args(["serve", "--max-queued-requests", "7"])
    config = RoutingConfig(**_routing(args))
    fields = {f.name for f in dataclasses.fields(config)}
    assert {"max_queued_requests", "max_queued_tokens", "max_running_requests"} <= fields
    assert config.max_queued_requests == 7
