"""Job records in the metadata group: the pure table (leases, fencing, snapshot), then the same
commands through a journaled replica (restarted) and through the gRPC service."""

from __future__ import annotations

import pytest

from kvflow.replication import MetadataGroup, RemoteMetadata
from kvflow.replication.jobs import JobTable
from kvflow.replication.table import MetadataTable
from tests.replication.conftest import GroupFactory
from tests.replication.test_remote import served  # noqa: F401 - the fixture

LEASE = 5.0


def test_leases_fence_the_old_owner_and_a_snapshot_keeps_everything() -> None:
    t = JobTable()
    assert t.create("j1", b"doc", "router-a", LEASE, now=100.0)
    assert not t.create("j1", b"other", "router-b", LEASE, now=100.0)  # exists: unchanged
    assert t.append("j1", "router-a", [b"e1", b"e2"])
    assert not t.append("j1", "router-b", [b"x"])  # not the owner
    assert not t.claim("j1", "router-b", LEASE, now=104.9)  # a's lease is live
    assert t.claim("j1", "router-a", LEASE, now=104.0)  # renewal: until 109
    assert not t.claim("j1", "router-b", LEASE, now=108.0)
    assert t.claim("j1", "router-b", LEASE, now=109.5)  # lapsed: b takes over
    assert not t.append("j1", "router-a", [b"late"])  # a is fenced off
    assert t.append("j1", "router-b", [b"e3"])
    assert not t.release("j1", "router-a") and t.release("j1", "router-b")
    assert t.claim("j1", "router-c", LEASE, now=109.6)  # released: anyone at once
    r = t.record("j1")
    assert r is not None and r.events == (b"e1", b"e2", b"e3") and r.owner == "router-c"
    assert r.lease_until == pytest.approx(114.6) and r.doc == b"doc" and r.created_at == 100.0
    table = MetadataTable()
    table.apply_job("create", "j2", "r", b"d2", [], LEASE, 1.0)
    table.apply_job("append", "j2", "r", b"", [b"x"], 0.0, 2.0)
    copy = MetadataTable()
    copy.restore(table.snapshot())
    assert copy.jobs.record("j2") == table.jobs.record("j2")
    with pytest.raises(ValueError, match="op"):
        table.apply_job("drop", "j2", "r", b"", [], 0.0, 3.0)


def test_a_journaled_replica_keeps_jobs_across_a_restart(
    open_group: GroupFactory, single_config
) -> None:
    group = open_group(single_config)
    group.wait_ready(10)
    assert group.job_write("create", "j1", "r1", 10.0, doc=b"doc", lease_s=LEASE)
    assert group.job_write("append", "j1", "r1", 11.0, events=[b"a", b"b"])
    assert not group.job_write("append", "j1", "r2", 11.0, events=[b"c"])
    with pytest.raises(ValueError, match="owner"):
        group.job_write("append", "j1", "", 11.0)
    with pytest.raises(ValueError, match="lease_s"):
        group.job_write("claim", "j1", "r2", 11.0)
    group.close()
    again = open_group(single_config)
    again.wait_ready(10)
    (record,), _ = again.job_read()
    assert record.events == (b"a", b"b") and record.owner == "r1" and record.doc == b"doc"


def test_remote_job_commands_match_the_group(served: tuple[MetadataGroup, str]) -> None:  # noqa: F811
    group, address = served
    with RemoteMetadata([address]) as meta:
        assert meta.job_write("create", "j9", "r1", doc=b"d", lease_s=0.2)
        assert meta.job_write("append", "j9", "r1", events=[b"e"])
        jobs, server_now = meta.job_read()
        assert [j.job_id for j in jobs] == ["j9"] and jobs[0].events == (b"e",)
        assert jobs[0].lease_until <= server_now + 0.2
        assert meta.job_read("nope")[0] == []
    assert group.view().jobs("j9")[0].owner == "r1"
