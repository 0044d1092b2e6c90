"""Which modules run compiled, and whether each compiled module still matches its source.

The build compiles a few modules with mypyc (``setup.py`` lists them) and records each one's
source hash in ``kvflow/_compiled.json``. An extension module takes precedence over its ``.py``
on import, so after an edit to a compiled module's source the old code keeps running until the
extensions are rebuilt (``make compile``): :func:`stale_modules` names such modules. The test
suite refuses to run with any, and the simulator's benchmark says what it measured.

Reads files only; imports nothing of kvflow until asked about a module.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
from pathlib import Path

MANIFEST = Path(__file__).with_name("_compiled.json")
"""Written by the compiled build beside the package: ``{"modules": {module: sha256 of its
source}}``. Absent from a pure-Python build (``KVFLOW_COMPILE=0``)."""


def built_modules(manifest: Path = MANIFEST) -> dict[str, str]:
    """The modules the build compiled, with their sources' sha256 then (empty when none).
    ValueError when the manifest is not the build's."""
    try:
        document = json.loads(manifest.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(f"{manifest}: not JSON ({exc}); rebuild with `make compile`") from exc
    modules = document.get("modules") if isinstance(document, dict) else None
    if not isinstance(modules, dict):
        raise ValueError(f"{manifest}: no 'modules' object; rebuild with `make compile`")
    return {str(name): str(digest) for name, digest in modules.items()}


def _origin(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _is_extension(path: Path) -> bool:
    return path.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def compiled_modules(manifest: Path = MANIFEST) -> list[str]:
    """The built modules that import as their extension (sorted)."""
    built = built_modules(manifest)
    return sorted(m for m in built if (o := _origin(m)) is not None and _is_extension(o))


def stale_modules(manifest: Path = MANIFEST) -> list[str]:
    """The compiled modules whose ``.py`` changed since the build: their import runs the old,
    compiled code (sorted)."""
    stale = []
    for module, digest in built_modules(manifest).items():
        origin = _origin(module)
        if origin is None or not _is_extension(origin):
            continue
        source = origin.with_name(module.rsplit(".", 1)[-1] + ".py")
        if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != digest:
            stale.append(module)
    return sorted(stale)


def describe() -> str:
    """One line: ``compiled (N modules)``, ``interpreted``, or what is stale."""
    stale = stale_modules()
    if stale:
        return f"stale ({', '.join(stale)}: run `make compile`)"
    compiled = compiled_modules()
    return f"compiled ({len(compiled)} modules)" if compiled else "interpreted"
