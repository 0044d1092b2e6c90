"""kvflow's build: the package as pyproject.toml declares it, plus C extensions of the modules in
:data:`COMPILED`, made by mypyc from the same typed source (what the simulator and the
conductor spend their time in; see the README's "Compiled modules").

``KVFLOW_COMPILE=0`` builds the pure-Python package (no C compiler needed). A compiled build
writes ``kvflow/_compiled.json`` (each compiled module's source hash) beside the package, which
:mod:`kvflow.compiled` reads to say what runs compiled and to catch an extension older than
its source. ``make compile`` rebuilds the extensions in place after a source change.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

COMPILED = (
    "kvflow/router/local_index.py",
    "kvflow/router/estimators.py",
    "kvflow/router/scoring.py",
    "kvflow/router/conductor.py",
    "kvflow/router/sim_loads.py",
    "kvflow/router/sim_decode.py",
    "kvflow/router/sim_prefill.py",
    "kvflow/router/simulator.py",
)
MANIFEST = "kvflow/_compiled.json"
ROOT = Path(__file__).resolve().parent
GENERATED = ROOT / "build" / "mypyc"
"""Where mypyc writes the C it generates (kept between builds: unchanged files are not
recompiled)."""


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _BuildExt(build_ext):
    """build_ext that also writes the manifest where the extensions went; an in-place build
    without them (``KVFLOW_COMPILE=0``) removes those of an earlier build, and the manifest."""

    def run(self) -> None:
        super().run()
        if not self.extensions:
            if self.inplace:
                for path in COMPILED:
                    source = ROOT / path
                    for built in source.parent.glob(f"{source.stem}[.]*.so"):
                        built.unlink()
                    for built in source.parent.glob(f"{source.stem}__mypyc[.]*.so"):
                        built.unlink()
                (ROOT / MANIFEST).unlink(missing_ok=True)
            return
        # <out>/kvflow/router/simulator.<abi>.so -> <out>
        out = Path(self.get_ext_fullpath(_module(COMPILED[0]))).parents[2]
        sources = {_module(p): _source_hash(ROOT / p) for p in COMPILED}
        target = out / MANIFEST
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"modules": sources}, indent=1, sort_keys=True) + "\n")


def _extensions() -> list:
    if os.environ.get("KVFLOW_COMPILE", "1") == "0":
        return []
    from mypyc.build import mypycify  # the build's requirement (pyproject.toml)

    # [tool.mypy] in pyproject.toml: third-party packages are opaque (Any) to the build, so
    # the generated C is the same whatever else is installed
    # separate: each module with its own runtime library beside it, inside the package (the
    # default is one top-level library named by a hash, which an editable install's finder
    # does not know after an in-place rebuild); the same instruction count at 64+64
    args = ["--config-file", str(ROOT / "pyproject.toml"), "--no-incremental", *COMPILED]
    try:
        return mypycify(args, opt_level="3", separate=True, target_dir=str(GENERATED))
    except ValueError:
        # mypyc 2.4.1 can crash reusing what an earlier build left in GENERATED (seen when a
        # type alias moved between modules); from scratch it does not
        print(f"mypyc failed over {GENERATED.relative_to(ROOT)}: generating the C afresh")
        shutil.rmtree(GENERATED, ignore_errors=True)
        return mypycify(args, opt_level="3", separate=True, target_dir=str(GENERATED))


setup(ext_modules=_extensions(), cmdclass={"build_ext": _BuildExt})
