"""A damaged replica journal is moved aside before pysyncobj reads it, and the replica starts
empty and catches up from its peers.

pysyncobj trusts its files: a truncated or overwritten ``raft.journal`` makes its constructor
raise (a replica restarted by a supervisor then fails forever), a damaged ``raft.dump`` is
logged and skipped (the state it held silently missing), and an unreadable
``raft.journal.meta`` reads as "term 0, no vote". ``check_journal`` reads the three files
without unpickling anything; ``repair_journal`` moves the set aside (``dir_guard.move_aside``)
when one is damaged and says so in one log line.

An emptied replica must not vote until it has caught up (:class:`VoteHold`): it forgot the
entries it had acknowledged and the vote it gave, so its vote could elect a leader that
lacks a committed entry. It still acknowledges the entries the leader sends it (it holds
them again). A group of one replica (an embedded server) has no peers: it starts empty, and
the store re-adopts its holdings from the node's own files.
"""

from __future__ import annotations

import gzip
import logging
import pickletools
import struct
import zlib
from pathlib import Path

from kvflow.replication.config import DUMP_FILE, JOURNAL_FILE
from kvflow.replication.dir_guard import move_aside

logger = logging.getLogger(__name__)

# pysyncobj's journal layout (pysyncobj/journal.py, format version 1): a 40-byte header (app
# name padded to 24 bytes, version 8, format version u32, end offset of the last record u32),
# then records "size u32 | index u64 | term u64 | command | size u32", size = 16 + command.
_APP_NAME = b"PYSYNCOBJ"
_HEADER = struct.Struct("<24s8sII")
_FORMAT_VERSION = 1
_SIZE = struct.Struct("<I")
_INDEX_TERM = struct.Struct("<QQ")
_COMMAND_TYPES = range(4)  # REGULAR, NO_OP, MEMBERSHIP, VERSION
_REGULAR = 0
META_SUFFIX = ".meta"


class JournalDamage(Exception):
    """What is wrong with a journal file (the message names the file and the place)."""


def check_journal(journal_dir: Path) -> None:
    """Raise JournalDamage when a file of the journal in ``journal_dir`` is damaged; return
    when every file present is whole (absent files are a new replica's, not damage)."""
    journal = journal_dir / JOURNAL_FILE
    if journal.exists():
        _check_log(journal)
    meta = journal_dir / (JOURNAL_FILE + META_SUFFIX)
    if meta.exists():
        _check_pickle(meta, meta.read_bytes())
    dump = journal_dir / DUMP_FILE
    if dump.exists():
        _check_dump(dump)


def _check_log(path: Path) -> None:
    data = path.read_bytes()
    if len(data) < _HEADER.size:
        raise JournalDamage(f"{path}: {len(data)} bytes, shorter than its header")
    name, _version, fmt, end = _HEADER.unpack_from(data)
    if name.rstrip(b"\0") != _APP_NAME or fmt != _FORMAT_VERSION:
        raise JournalDamage(f"{path}: not a pysyncobj journal (format {fmt}, name {name!r:.40})")
    if not _HEADER.size <= end <= len(data):
        raise JournalDamage(f"{path}: last record ends at {end}, file has {len(data)} bytes")
    offset, previous = _HEADER.size, None
    while offset < end:
        if offset + _SIZE.size > end:
            raise JournalDamage(f"{path}: record header cut at offset {offset}")
        (size,) = _SIZE.unpack_from(data, offset)
        stop = offset + _SIZE.size + size
        if size < _INDEX_TERM.size + 1 or stop + _SIZE.size > end:
            raise JournalDamage(f"{path}: record at offset {offset} claims {size} bytes")
        if _SIZE.unpack_from(data, stop)[0] != size:
            raise JournalDamage(f"{path}: record at offset {offset}: trailing size differs")
        index, term = _INDEX_TERM.unpack_from(data, offset + _SIZE.size)
        if previous is not None and (index != previous[0] + 1 or term < previous[1]):
            raise JournalDamage(
                f"{path}: record at offset {offset}: index {index} term {term} after "
                f"index {previous[0]} term {previous[1]}"
            )
        command = data[offset + _SIZE.size + _INDEX_TERM.size : stop]
        if command[0] not in _COMMAND_TYPES:
            raise JournalDamage(f"{path}: record {index}: unknown command type {command[0]}")
        if command[0] == _REGULAR:
            _check_pickle(path, command[1:], f"record {index}")
        previous = (index, term)
        offset = stop + _SIZE.size


def _check_pickle(path: Path, data: bytes, where: str = "") -> None:
    """A whole pickle (opcodes parsed up to STOP; nothing is executed)."""
    try:
        ops = list(pickletools.genops(data))
    except Exception as exc:  # genops raises ValueError and friends on bad opcodes
        raise JournalDamage(f"{path}: {where + ': ' if where else ''}bad pickle: {exc}") from exc
    if not ops or ops[-1][0].name != "STOP":
        raise JournalDamage(f"{path}: {where + ': ' if where else ''}pickle without STOP")


def _check_dump(path: Path) -> None:
    """The whole gzip stream decompresses and its CRC matches (the pickle is not loaded)."""
    try:
        with gzip.open(path, "rb") as stream:
            while stream.read(1 << 20):
                pass
    except (OSError, EOFError, zlib.error) as exc:
        raise JournalDamage(f"{path}: damaged snapshot: {exc}") from exc


def repair_journal(journal_dir: Path, has_peers: bool) -> bool:
    """Move a damaged journal aside (every file of it, renamed ``*.damaged-<time>``) and log
    one line. Returns True when it did: the replica then starts empty."""
    try:
        check_journal(journal_dir)
    except JournalDamage as damage:
        names = (JOURNAL_FILE, JOURNAL_FILE + META_SUFFIX, DUMP_FILE)
        moved = [move_aside(journal_dir / n).name for n in names if (journal_dir / n).exists()]
        logger.warning(
            "metadata journal damaged (%s); moved aside as %s; %s",
            damage,
            ", ".join(moved),
            "rejoining from the peers (no vote until caught up)"
            if has_peers
            else "starting empty (holdings are re-adopted from the node's store)",
        )
        return True
    return False


class VoteHold:
    """While held, the replica answers no vote request (pysyncobj's ``request_vote``
    messages are dropped by the transport, ``raft_gate.GatedTransport``); the group releases
    it once the replica has applied what the leader had committed when it joined."""

    def __init__(self, held: bool) -> None:
        self.held = held

    def withholds(self, message: object) -> bool:
        return self.held and isinstance(message, dict) and message.get("type") == "request_vote"

    def release(self, who: str) -> None:
        if self.held:
            self.held = False
            logger.info("metadata replica %s caught up after a journal repair; it votes again", who)
