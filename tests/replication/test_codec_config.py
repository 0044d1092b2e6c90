"""Compact payload encoding and config validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.replication import MetadataConfig
from kvflow.replication.codec import chunk_bounds, pack_keys, unpack_keys


def test_fixed_width_keys_pack_to_one_blob() -> None:
    keys = [bytes([i]) * 16 for i in range(4)]
    width, blob = pack_keys(keys)
    assert (width, len(blob)) == (16, 64)
    assert unpack_keys(width, blob) == keys


def test_variable_width_keys_round_trip() -> None:
    keys = [b"a", b"bcd", b"x" * 300]
    width, blob = pack_keys(keys)
    assert width == 0
    assert len(blob) == 2 * 3 + 1 + 3 + 300
    assert unpack_keys(width, blob) == keys
    assert pack_keys([]) == (0, b"") and unpack_keys(0, b"") == []


def test_malformed_blobs_are_rejected() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        unpack_keys(16, b"x" * 17)
    with pytest.raises(ValueError, match="truncated"):
        unpack_keys(0, b"\x05\x00ab")
    with pytest.raises(ValueError, match="truncated variable-width key length"):
        unpack_keys(0, b"\x00")  # half a length prefix (was a struct.error: UNKNOWN on the wire)
    with pytest.raises(ValueError, match="truncated variable-width key length"):
        unpack_keys(0, b"\x01\x00a\x07")


def test_chunk_bounds_respects_byte_budget() -> None:
    keys = [b"k" * 16] * 10  # 18 bytes each with framing
    assert chunk_bounds(keys, 36) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert chunk_bounds(keys, 10_000) == [(0, 10)]
    assert chunk_bounds([b"k" * 100], 10) == [(0, 1)]  # one oversize key still goes alone
    assert chunk_bounds([], 10) == [(0, 0)]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"self_address": "localhost"}, "self_address"),
        ({"self_address": "127.0.0.1:0"}, "self_address"),
        ({"partner_addresses": ["127.0.0.1:2"]}, "partner_addresses"),
        ({"partner_addresses": ("127.0.0.1:1",)}, "partner_addresses"),
        ({"partner_addresses": ("127.0.0.1:2", "127.0.0.1:2")}, "partner_addresses"),
        ({"journal_dir": "/tmp/x"}, "journal_dir"),
        ({"commit_timeout_s": 0}, "commit_timeout_s"),
        ({"node_dead_after_s": -1.0}, "node_dead_after_s"),
        ({"raft_min_timeout_s": 0.1}, "raft_min_timeout_s"),
        ({"raft_max_timeout_s": 0.3}, "raft_max_timeout_s"),
        ({"max_entry_bytes": 10}, "max_entry_bytes"),
        ({"bind_retries": 0}, "bind_retries"),
        ({"log_compaction_min_entries": 1}, "log_compaction_min_entries"),
    ],
)
def test_config_rejects_bad_fields_by_name(overrides: dict[str, object], field: str) -> None:
    fields: dict[str, object] = {"self_address": "127.0.0.1:1", **overrides}
    with pytest.raises(ValueError, match=field):
        MetadataConfig(**fields)  # type: ignore[arg-type]


def test_config_paths_and_size(tmp_path: Path) -> None:
    config = MetadataConfig(
        self_address="127.0.0.1:1",
        partner_addresses=("127.0.0.1:2", "127.0.0.1:3"),
        journal_dir=tmp_path,
        password="group-password",
    )
    assert config.num_replicas == 3
    assert config.journal_path == tmp_path / "raft.journal"
    assert config.dump_path == tmp_path / "raft.dump"
    memory = MetadataConfig(self_address="127.0.0.1:1")
    assert memory.journal_path is None and memory.dump_path is None


def test_a_replica_with_partners_never_runs_without_a_password(monkeypatch) -> None:
    monkeypatch.delenv("KVFLOW_CLUSTER_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="cluster secret"):
        MetadataConfig(self_address="127.0.0.1:1", partner_addresses=("127.0.0.1:2",))
