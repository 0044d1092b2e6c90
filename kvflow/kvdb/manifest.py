"""The data directory's manifest: format version, engine and model fingerprint.

Written atomically (temp file + rename) when a data directory is first used; checked on every
open so that a directory written by an incompatible version, another engine or another model
is a clear error rather than garbage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvflow.kvdb.config import DEFAULT_ENGINE
from kvflow.kvdb.errors import (
    DamagedManifestError,
    IncompatibleDataDirError,
    NamespaceMismatchError,
)

MANIFEST_NAME = "kvdb-manifest.json"
FORMAT_NAME = "kvflow.kvdb"
FORMAT_VERSION = 4
# What each older version lacks, for the refusal message.
_OLDER = {
    1: "its checksums cover the value only, not the block key and parent",
    2: "its records carry no owner tenant",
    3: "its checksums do not cover the block's owner tenant",
}


def engine_for(data_dir: Path | None, configured: str | None) -> str:
    """The SSD engine to open ``data_dir`` with: ``configured`` if given, else the engine its
    manifest records (a directory keeps the engine it was written with, so a default that
    changed never refuses it), else ``DEFAULT_ENGINE``. An unreadable manifest counts as none:
    opening the directory reports it."""
    if configured is not None:
        return configured
    if data_dir is not None:
        try:
            body = json.loads((data_dir / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            body = None
        if isinstance(body, dict) and body.get("format") == FORMAT_NAME:
            engine = body.get("engine")
            if engine in ("lmdb", "rocksdb"):  # a "memory" tier left nothing to keep
                return str(engine)
    return DEFAULT_ENGINE


def check_or_create(data_dir: Path, engine: str, fingerprint: str) -> bool:
    """Validate ``data_dir``'s manifest, or write one if the directory is new.

    Returns True if the directory already held a store. Raises IncompatibleDataDirError for
    another format/version/engine or an unreadable manifest, or for existing SSD files with no
    manifest; NamespaceMismatchError for another model fingerprint.
    """
    path = data_dir / MANIFEST_NAME
    if not path.exists():
        ssd = data_dir / "ssd"
        if ssd.exists() and any(ssd.iterdir()):
            raise IncompatibleDataDirError(
                f"{data_dir}: SSD files without {MANIFEST_NAME}; not written by this version"
            )
        _write(data_dir, engine, fingerprint)
        return False
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DamagedManifestError(f"{path}: unreadable manifest: {exc}") from exc
    if not isinstance(body, dict):
        raise DamagedManifestError(f"{path}: unreadable manifest: not a JSON object")
    if body.get("format") != FORMAT_NAME:
        raise IncompatibleDataDirError(f"{path}: not a kvflow kvdb data directory")
    version = body.get("format_version")
    if version != FORMAT_VERSION:
        why = _OLDER.get(version) if isinstance(version, int) else None
        raise IncompatibleDataDirError(
            f"{path}: format version {version!r}, this build reads {FORMAT_VERSION}"
            + (f" ({why}); it is a cache: delete the directory to start afresh" if why else "")
        )
    if body.get("fingerprint") != fingerprint:
        raise NamespaceMismatchError(
            f"{path}: holds blocks of model fingerprint {body.get('fingerprint')!r}, "
            f"opened for {fingerprint!r}"
        )
    if body.get("engine") == "memory" and engine != "memory":
        _write(data_dir, engine, fingerprint)  # a memory tier kept nothing on disk
        return False
    if body.get("engine") != engine:
        raise IncompatibleDataDirError(
            f"{path}: written by engine {body.get('engine')!r}, configured engine is {engine!r}; "
            f"configure {body.get('engine')!r} (`kvflow serve` and kvflow members: or no "
            "engine at all, and the directory keeps its own), or delete the directory (a "
            "cache) to start afresh"
        )
    return True


def _write(data_dir: Path, engine: str, fingerprint: str) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    body = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "engine": engine,
        "fingerprint": fingerprint,
    }
    path = data_dir / MANIFEST_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, path)
