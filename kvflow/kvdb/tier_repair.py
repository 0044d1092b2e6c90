"""The SSD tier only holds a cache: a damaged one is moved aside and the shard starts empty.

* ``check_lmdb`` reads the two meta pages of an LMDB ``data.mdb`` and refuses a file shorter
  than the last page they name: LMDB maps the file, and touching a page past its end is a
  SIGBUS that kills the process (no exception to catch). It runs before LMDB opens the file.
* ``open_engine`` opens the tier's engine; when the check fails or the engine refuses its
  files (RocksDB "Corruption", LMDB "Invalid argument", ...) the tier directory is renamed
  ``ssd.damaged-<UTC time>`` (``dir_guard.move_aside``), one line is logged, and a fresh
  engine opens in its place. ``reopen_empty`` does the same for damage found later while
  the shard re-adopts the records (a scan that fails). The blocks it held are misses:
  refetched from a peer or recomputed.

* ``check_manifest``: an unreadable ``kvdb-manifest.json`` is moved aside with the tier.

Records damaged one by one are not this module's: ``SsdTier.adopt`` drops them by checksum.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

from kvflow.kvdb import manifest
from kvflow.kvdb.config import StoreConfig
from kvflow.kvdb.engines import ENGINES, StorageEngine
from kvflow.kvdb.errors import DamagedManifestError, StorageEngineError
from kvflow.replication.dir_guard import move_aside

logger = logging.getLogger(__name__)

LMDB_DATA = "data.mdb"
# LMDB (64-bit builds) meta page: a 16-byte page header, then MDB_meta: magic u32, version
# u32, address u64, mapsize u64, two MDB_db of 48 bytes (the first one's md_pad is the page
# size), last page number u64, transaction id u64. Pages 0 and 1 are the two meta pages.
_LMDB_MAGIC = 0xBEEFC0DE
_MAGIC = struct.Struct("<II")
_MAGIC_AT = 16
_PSIZE_AT = 40
_LAST_AT = 136
_LAST_TXN = struct.Struct("<QQ")


class TierDamage(Exception):
    """The SSD tier's files cannot be used (the message says which and why)."""


def check_lmdb(directory: Path) -> None:
    """Raise TierDamage when ``directory/data.mdb`` is shorter than its meta pages say or has
    no valid meta page; return for a whole file or a new (absent or empty) one."""
    path = directory / LMDB_DATA
    if not path.exists() or path.stat().st_size == 0:
        return
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_LAST_AT + _LAST_TXN.size)
        if len(head) < _LAST_AT + _LAST_TXN.size:
            raise TierDamage(f"{path}: {size} bytes, shorter than an LMDB meta page")
        (psize,) = struct.unpack_from("<I", head, _PSIZE_AT)
        if psize < 512 or psize & (psize - 1) or size < 2 * psize:
            raise TierDamage(f"{path}: {size} bytes, page size {psize}: not a whole LMDB file")
        f.seek(psize)
        second = f.read(_LAST_AT + _LAST_TXN.size)
    metas = []
    for page in (head, second):
        magic, version = _MAGIC.unpack_from(page, _MAGIC_AT)
        if magic == _LMDB_MAGIC and version == 1:
            metas.append(_LAST_TXN.unpack_from(page, _LAST_AT))
    if not metas:
        raise TierDamage(f"{path}: no valid LMDB meta page")
    last_page, _txn = max(metas, key=lambda m: m[1])
    need = (last_page + 1) * psize
    if size < need:
        raise TierDamage(f"{path}: truncated: {size} bytes, its last page ends at {need}")


def check_manifest(config: StoreConfig, fingerprint: str) -> None:
    """``manifest.check_or_create``; a manifest that cannot be read at all (not one of
    another version, engine or model: those are refused) is moved aside with the tier it
    described, and a new one written."""
    assert config.data_dir is not None
    try:
        manifest.check_or_create(config.data_dir, config.engine, fingerprint)
    except DamagedManifestError as exc:
        moved = [
            move_aside(p)
            for p in (config.data_dir / manifest.MANIFEST_NAME, config.ssd_dir())
            if p is not None and p.exists()
        ]
        logger.warning(
            "kvdb data dir damaged (%s); moved aside as %s; starting with an empty tier (its "
            "blocks are misses)",
            " ".join(str(exc).split()),
            ", ".join(str(p) for p in moved),
        )
        manifest.check_or_create(config.data_dir, config.engine, fingerprint)


def _open(config: StoreConfig, map_size: int) -> StorageEngine:
    directory = config.ssd_dir()
    if config.engine == "lmdb" and directory is not None:
        check_lmdb(directory)
        # A tier written at a larger capacity: LMDB would map only what it holds, leaving no
        # free page for the deletes that trim it to the new capacity (MDB_MAP_FULL at open).
        held = directory / "data.mdb"
        if held.exists():
            map_size = max(map_size, held.stat().st_size + (64 << 20))
    return ENGINES[config.engine].open(directory, map_size)


def open_engine(config: StoreConfig, map_size: int) -> StorageEngine:
    """The tier's engine; a damaged tier is moved aside and a fresh one opened."""
    try:
        return _open(config, map_size)
    except (TierDamage, StorageEngineError) as exc:
        return _fresh(config, map_size, exc)


def reopen_empty(
    config: StoreConfig, map_size: int, broken: StorageEngine, exc: Exception
) -> StorageEngine:
    """Close ``broken`` (whose records could not be read back), move the tier aside and
    open a fresh engine."""
    try:
        broken.close()
    except Exception:  # the engine is being discarded; the damage is logged below
        logger.debug("closing the damaged SSD engine failed", exc_info=True)
    return _fresh(config, map_size, exc)


def _fresh(config: StoreConfig, map_size: int, exc: Exception) -> StorageEngine:
    directory = config.ssd_dir()
    if directory is None or not directory.exists():
        raise exc
    aside = move_aside(directory)
    logger.warning(
        "SSD tier damaged (%s); moved aside as %s; starting with an empty tier (its blocks "
        "are misses)",
        " ".join(str(exc).split()),  # one line, whatever the engine's message holds
        aside,
    )
    return _open(config, map_size)
