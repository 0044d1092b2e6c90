"""Reading the Mooncake request trace (JSON lines).

Each line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids":
[ids]}`` with one id per 512-token block of the input (the last one possibly partial); ids are
chained prefix ids, so equal ids at equal positions mean an equal prefix. The ids become opaque
8-byte block keys (:func:`hash_id_key`) so that the same router code serves traces and real keys.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kvflow.router.errors import TraceFormatError

TRACE_BLOCK_SIZE = 512
"""Tokens per hash id in the published Mooncake traces."""


@dataclass(frozen=True)
class TraceRecord:
    """One request of the trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @cached_property
    def block_keys(self) -> tuple[bytes, ...]:
        """The hash ids as block keys (:func:`hash_id_key`); ValueError for an id out of range.

        Computed on first access and kept (the fields are frozen, so the keys never change;
        :func:`parse_record` computes them as it reads): a simulation replaying the records
        several times converts each id once, not once per replay."""
        try:
            return tuple(map(_to_key, self.hash_ids))  # C-level: no per-id Python call
        except OverflowError:
            return tuple(hash_id_key(h) for h in self.hash_ids)  # raises the ValueError


_to_key = operator.methodcaller("to_bytes", 8, "big")


def hash_id_key(hash_id: int) -> bytes:
    """The block key of a trace hash id: 8 bytes, big-endian. ValueError outside [0, 2**64)."""
    if not 0 <= hash_id < 1 << 64:
        raise ValueError(f"hash_id must be in [0, 2**64), got {hash_id}")
    return hash_id.to_bytes(8, "big")


def _field_int(doc: dict[str, Any], name: str, where: str, minimum: int) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceFormatError(
            f"{where}: field {name!r} must be an integer >= {minimum}, got {value!r}"
        )
    return value


def parse_record(
    line: str, where: str = "trace", keys: dict[int, bytes] | None = None
) -> TraceRecord:
    """Parse one JSON line; TraceFormatError names ``where`` (e.g. ``path:line``) and the field.

    ``keys`` (hash id -> its block key), shared over the records of one trace, makes equal ids
    one ``bytes`` object: the prefix index then matches a key by identity instead of comparing
    bytes on every dictionary probe (2.6% of a simulation's instructions)."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise TraceFormatError(f"{where}: a record must be a JSON object")
    timestamp = _field_int(doc, "timestamp", where, 0)
    input_length = _field_int(doc, "input_length", where, 1)
    output_length = _field_int(doc, "output_length", where, 0)
    hash_ids = doc.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in hash_ids
    ):
        raise TraceFormatError(
            f"{where}: field 'hash_ids' must be a list of integers in [0, 2**64)"
        )
    record = TraceRecord(timestamp, input_length, output_length, tuple(hash_ids))
    if keys is None:
        record.block_keys  # noqa: B018 -- computed once here, at read (cached on the record)
    else:  # what the cached property stores, from the shared table
        record.__dict__["block_keys"] = _shared_keys(record.hash_ids, keys)
    return record


def _shared_keys(hash_ids: tuple[int, ...], keys: dict[int, bytes]) -> tuple[bytes, ...]:
    out = []
    for hash_id in hash_ids:  # ids were checked in range by the caller
        key = keys.get(hash_id)
        if key is None:
            key = keys[hash_id] = hash_id_key(hash_id)
        out.append(key)
    return tuple(out)


def read_trace(path: str | Path, start: int = 0, limit: int | None = None) -> list[TraceRecord]:
    """Records ``start .. start+limit`` of the file (blank lines skipped), in file order.

    Raises TraceFormatError for a malformed line in that range, ValueError for a negative
    ``start``/``limit``, OSError when the file cannot be read.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    records: list[TraceRecord] = []
    keys: dict[int, bytes] = {}  # one bytes object per distinct hash id (see parse_record)
    index = 0
    with Path(path).open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            if index >= start:
                records.append(parse_record(line, f"{path}:{line_no}", keys))
            index += 1
    return records
