"""The mypyc build (setup.py): what it compiled, the stale-build check, and that the compiled
simulator decides exactly as its interpreted source does."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow import compiled
from kvflow.router import SimulationConfig, read_trace, simulate

ROOT = Path(__file__).resolve().parents[1]
SLICE = ROOT / "tests" / "router" / "data" / "mooncake_slice_3600_3900.jsonl"


def _listed() -> set[str]:
    """setup.py's COMPILED, as module names (read, not run: running it would build)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "COMPILED":
            paths = ast.literal_eval(node.value)
            return {p.removesuffix(".py").replace("/", ".") for p in paths}
    raise AssertionError("setup.py has no COMPILED")


def _needs_compiled_build() -> None:
    if not compiled.compiled_modules():
        pytest.skip("a pure-Python build (KVFLOW_COMPILE=0): nothing compiled to check")


def test_the_build_compiled_what_setup_lists_or_nothing():
    built = compiled.built_modules()
    if built:  # a compiled build: every listed module, each importing as its extension
        assert set(built) == _listed()
        assert compiled.compiled_modules() == sorted(_listed())
        assert compiled.describe() == f"compiled ({len(_listed())} modules)"
    else:  # a pure-Python build leaves no extension behind
        assert compiled.describe() == "interpreted"
        assert compiled.compiled_modules() == []


def test_a_changed_source_makes_its_module_stale(tmp_path):
    _needs_compiled_build()
    built = compiled.built_modules()
    manifest = tmp_path / "_compiled.json"
    manifest.write_text(json.dumps({"modules": built}))
    assert compiled.stale_modules(manifest) == []
    edited = dict(built, **{"kvflow.router.sim_loads": "0" * 64})  # as if the source changed
    manifest.write_text(json.dumps({"modules": edited}))
    assert compiled.stale_modules(manifest) == ["kvflow.router.sim_loads"]


def test_a_missing_or_broken_manifest(tmp_path):
    assert compiled.built_modules(tmp_path / "absent.json") == {}
    assert compiled.stale_modules(tmp_path / "absent.json") == []
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not JSON"):
        compiled.built_modules(broken)
    broken.write_text('{"modules": []}')
    with pytest.raises(ValueError, match="no 'modules' object"):
        compiled.built_modules(broken)


# Runs the simulator with every listed module imported from its .py source (a finder ahead of
# the extension finder), prints each report and its outcomes as JSON.
_INTERPRETED_RUN = """
import dataclasses, importlib.util, json, sys
from pathlib import Path

names = set(json.loads(sys.argv[1]))

class Source:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in names:
            return None
        for entry in path or ():
            source = Path(entry) / (name.rsplit(".", 1)[-1] + ".py")
            if source.exists():
                return importlib.util.spec_from_file_location(name, source)
        return None

sys.meta_path.insert(0, Source)
sys.path.insert(0, ".")
from kvflow.compiled import compiled_modules
from kvflow.router import read_trace, simulate
from tests.test_compiled import _configs
assert compiled_modules() == [], compiled_modules()
records = read_trace(sys.argv[2])
out = []
for config in _configs():
    report = simulate(config, records)
    out.append([report.to_dict(), [dataclasses.asdict(o) for o in report.outcomes]])
print(json.dumps(out))
"""


def _configs() -> list[SimulationConfig]:
    """Runs that batch, chunk, evict, pull and reject (both SLOs), under two policies."""
    base = SimulationConfig(num_prefill=8, num_decode=4)
    return [
        base,
        dataclasses.replace(base, cache_capacity_blocks=64, prefill_chunk_tokens=2048),
        dataclasses.replace(
            base, router=dataclasses.replace(base.router, tbt_slo_s=0.026, ttft_slo_s=4.0)
        ),
        dataclasses.replace(
            SimulationConfig(num_prefill=16, num_decode=24),
            router=dataclasses.replace(base.router, policy="local-cache-aware"),
        ),
    ]


def test_the_compiled_simulator_equals_its_interpreted_source():
    """Every report field and request outcome of compiled runs equal the interpreted code's
    (float for float)."""
    _needs_compiled_build()
    records = read_trace(SLICE)
    here = []
    for config in _configs():
        report = simulate(config, records)
        here.append([report.to_dict(), [dataclasses.asdict(o) for o in report.outcomes]])
    run = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_RUN, json.dumps(sorted(_listed())), str(SLICE)],
        capture_output=True, text=True, timeout=240, check=False, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    there = json.loads(run.stdout)
    assert json.loads(json.dumps(here)) == there
    assert here[1][0]["evicted_blocks"] > 0 and here[0][0]["pulls"] > 0
    assert set(here[2][0]["rejected_by_reason"]) == {"ttft_slo", "tbt_slo"}
