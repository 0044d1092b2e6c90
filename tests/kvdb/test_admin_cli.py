"""`kvflow kvdb ...` run in-process (kvflow.tools.cli.main) against a real admin server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.kvdb import Tier
from kvflow.tools.cli import main
from kvflow.tools.kvadmin import human_bytes, table
from tests.conftest import pick_free_port
from tests.kvdb.conftest import NBYTES, keys
from tests.kvdb.test_admin_service import Admin, fill, read


@pytest.fixture
def admin(tmp_path: Path, free_port: int) -> Iterator[Admin]:
    a = Admin(tmp_path, free_port)
    ks = fill(a.shards["s0"], 4)
    read(a.shards["s0"], ks[1], 3)
    yield a
    a.close()


def run(capsys: pytest.CaptureFixture[str], admin: Admin, *argv: str) -> tuple[int, str, str]:
    code = main(["kvdb", "--server", admin.address, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_nodes_table_and_json(admin: Admin, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, admin, "nodes")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "NODE",
        "KIND",
        "ADDRESS",
        "HEALTHY",
        "BLOCKS",
        "HEARTBEAT",
        "SHARD",
    ]
    assert lines[1].split() == ["node-a", "prefill", "10.0.0.1:7000", "yes", "4", "-", "s0"]
    assert lines[2].split() == ["node-b", "decode", "-", "yes", "0", "-", "s1"]
    assert lines[0].index("BLOCKS") + len("BLOCKS") == lines[1].index("4") + 1  # right-aligned
    assert lines[-1] == "4 distinct blocks"
    code, out, _ = run(capsys, admin, "--json", "nodes")
    nodes = json.loads(out)
    assert code == 0 and isinstance(nodes, list) and len(nodes) == 2
    assert nodes[0]["node"] == "node-a" and nodes[0]["blocks"] == 4 and nodes[0]["healthy"] is True
    assert nodes[1] == json.loads(run(capsys, admin, "nodes", "--json")[1])[1]  # flag after


def test_shards_and_tiers(admin: Admin, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, admin, "shards")
    assert code == 0 and "rocksdb" in out and "4.0 KiB / 8.0 KiB" in out
    shards = json.loads(run(capsys, admin, "shards", "--json")[1])
    assert [s["shard"] for s in shards] == ["s0", "s1"]
    assert shards[0]["dram"] == {
        "blocks": 4,
        "used_bytes": 4 * NBYTES,
        "capacity_bytes": 8 * NBYTES,
    }
    code, out, _ = run(capsys, admin, "tiers", "--shard", "s0")
    header, dram, _ = out.splitlines()
    assert header.split()[:4] == ["SHARD", "TIER", "HITS", "MISSES"]
    assert dram.split()[:5] == ["s0", "dram", "3", "0", "100.0%"]
    tiers = json.loads(run(capsys, admin, "tiers", "--json")[1])
    assert len(tiers) == 4 and tiers[0]["hits"] == 3 and tiers[0]["bytes_read"] == 3 * NBYTES


def test_replicas_hot_stats(admin: Admin, capsys: pytest.CaptureFixture[str]) -> None:
    k = keys(4)[1]
    code, out, _ = run(capsys, admin, "replicas", k.hex())
    assert code == 0
    assert out.splitlines()[0] == f"key {k.hex()}"
    assert out.splitlines()[2].split() == ["node-a", "dram", "local", "s0"]
    data = json.loads(run(capsys, admin, "replicas", k.hex(), "--json")[1])
    assert data["replicas"] == [
        {"node": "node-a", "tier": "dram", "source": "local", "shard": "s0"}
    ]
    code, out, _ = run(capsys, admin, "hot", "-n", "1")
    assert code == 0 and out.splitlines()[1].split()[:3] == [k.hex(), "3", "dram"]
    hot = json.loads(run(capsys, admin, "--json", "hot")[1])
    assert [(b["key"], b["hits"]) for b in hot] == [(k.hex(), 3)]
    code, out, _ = run(capsys, admin, "stats")
    rows = [line.split() for line in out.splitlines()]
    assert rows[1][:4] == ["s0", "4", "0", "3"] and rows[-1][0] == "total"
    stats = json.loads(run(capsys, admin, "stats", "--json")[1])
    assert stats["total"]["puts"] == 4 and stats["total"]["hits"] == 3


def test_evict(admin: Admin, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, admin, "evict", "--shard", "s0", "--tier", "dram", "--bytes", "1K")
    assert code == 0
    assert out.strip() == (
        "evicted 1 blocks from dram of shard s0: 4.0 KiB -> 3.0 KiB used (4 -> 3 blocks)"
    )
    assert admin.shards["s0"].tier_of(keys(4)[3]) is Tier.SSD
    code, out, _ = run(
        capsys, admin, "evict", "--shard", "s0", "--tier", "ssd", "--bytes", "0", "--json"
    )
    assert code == 0 and json.loads(out)["blocks_evicted"] == 0


def test_server_errors_exit_1_with_code_on_stderr(
    admin: Admin, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys, admin, "evict", "--shard", "nope", "--tier", "dram", "--bytes", "1"
    )
    assert code == 1 and out == ""
    assert err.startswith("kvflow kvdb evict: NOT_FOUND: no shard 'nope' here")
    code, _, err = run(capsys, admin, "tiers", "--shard", "x")
    assert code == 1 and "NOT_FOUND" in err


def test_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    port = pick_free_port()
    code = main(["kvdb", "--server", f"127.0.0.1:{port}", "--timeout", "0.5", "nodes"])
    err = capsys.readouterr().err
    assert code == 1 and ("UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["hot", "-n", "0"], "must be in [1, 10000]"),
        (["hot", "-n", "x"], "not an integer"),
        (["replicas", "abc"], "32 hex characters"),
        (["replicas"], "required"),
        (["evict", "--shard", "s0", "--tier", "dram", "--bytes", "-5"], "must be >= 0"),
        (["evict", "--shard", "s0", "--tier", "hbm", "--bytes", "1"], "invalid choice"),
        (["evict", "--tier", "dram", "--bytes", "1"], "--shard"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_local_arguments_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["kvdb", "--server", "127.0.0.1:1", *argv])
    assert info.value.code == 2
    assert words in capsys.readouterr().err


def test_table_and_sizes() -> None:
    assert table(["A", "NUM"], [["x", 5], ["long", 123]]).splitlines() == [
        "A     NUM",
        "x       5",
        "long  123",
    ]
    assert [human_bytes(n) for n in (5, 2048, 3 << 20, 5 << 30)] == [
        "5 B",
        "2.0 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]
