"""Reading the Mooncake trace format."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.router import TraceFormatError, hash_id_key, read_trace

SLICE = Path(__file__).parent / "data" / "mooncake_slice_3600_3900.jsonl"


def test_reads_slice_with_start_and_limit():
    records = read_trace(SLICE)
    assert len(records) == 300
    part = read_trace(SLICE, start=10, limit=5)
    assert part == records[10:15]
    first = records[0]
    assert len(first.hash_ids) == -(-first.input_length // 512)
    assert first.block_keys[0] == hash_id_key(first.hash_ids[0])
    assert hash_id_key(1) == b"\x00" * 7 + b"\x01"


def test_equal_hash_ids_share_one_key_object():
    records = read_trace(SLICE)
    by_id: dict[int, bytes] = {}
    for record in records:
        assert record.block_keys == tuple(hash_id_key(h) for h in record.hash_ids)
        for hash_id, key in zip(record.hash_ids, record.block_keys, strict=True):
            seen = by_id.setdefault(hash_id, key)
            assert seen is key, hash_id
    assert len(by_id) < sum(len(r.hash_ids) for r in records)  # the slice does share prefixes


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
            "input_length",
        ),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}', "output_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ],
)
def test_malformed_lines_name_line_and_field(tmp_path, line, match):
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceFormatError, match=match) as info:
        read_trace(path)
    assert ":3:" in str(info.value)
    assert len(read_trace(path, limit=1)) == 1
