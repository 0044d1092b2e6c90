"""The memory a process may plan with: MemAvailable, at most the headroom its memory cgroups
leave (a container's /proc/meminfo is the host's), cgroup v1 and v2, limits on ancestors
too, and "no limit" read as none."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.stages.engine import meminfo

GIB = 1 << 30


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")


def test_v2_takes_the_least_headroom_up_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root, cgroup_controllers="memory cpu")
    _write(root / "kubepods", memory_max=str(8 * GIB), memory_current=str(5 * GIB))
    _write(root / "kubepods" / "pod1", memory_max=str(4 * GIB), memory_current=str(GIB))
    _write(root / "kubepods" / "pod1" / "c1", memory_max="max", memory_current=str(GIB))
    member = tmp_path / "cgroup"
    member.write_text("0::/kubepods/pod1/c1\n")
    assert meminfo.cgroup_headroom_bytes(root, member) == 3 * GIB  # the parent's 8 - 5
    member.write_text("0::/\n")  # a namespaced view: the container's cgroup is the root
    _write(root, memory_max=str(2 * GIB), memory_current=str(GIB // 2))
    assert meminfo.cgroup_headroom_bytes(root, member) == GIB + GIB // 2
    # the inactive file cache counts as free: the kernel reclaims it before the limit
    (root / "memory.stat").write_text(f"anon {GIB // 4}\ninactive_file {GIB // 4}\n")
    assert meminfo.cgroup_headroom_bytes(root, member) == GIB + 3 * GIB // 4


def test_v1_reads_the_memory_controller_and_no_limit_is_none(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    mem = root / "memory"
    _write(mem, memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="100")
    _write(mem / "api" / "c9", memory_limit_in_bytes=str(6 * GIB), memory_usage_in_bytes=str(GIB))
    member = tmp_path / "cgroup"
    member.write_text("5:devices:/\n4:memory:/api/c9\n0::/\n")
    assert meminfo.cgroup_headroom_bytes(root, member) == 5 * GIB
    (mem / "api" / "c9" / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {GIB}\n")
    assert meminfo.cgroup_headroom_bytes(root, member) == 6 * GIB
    member.write_text("4:memory:/elsewhere\n")  # not under this mount: its root only
    assert meminfo.cgroup_headroom_bytes(root, member) is None  # unlimited
    assert meminfo.cgroup_headroom_bytes(root, tmp_path / "missing") is None


def test_available_memory_is_at_most_the_cgroup_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meminfo, "_mem_available", lambda: 20 * GIB)
    monkeypatch.setattr(meminfo, "cgroup_headroom_bytes", lambda: 3 * GIB)
    assert meminfo.available_memory_bytes() == 3 * GIB
    monkeypatch.setattr(meminfo, "cgroup_headroom_bytes", lambda: None)
    assert meminfo.available_memory_bytes() == 20 * GIB
    monkeypatch.setattr(meminfo, "_mem_available", lambda: None)
    assert meminfo.available_memory_bytes() is None
