"""The memory this process has available now: what the server's memory plan
(stages/serve/memory.py) and the engine's default linear backend (onednn_linear.py) size
themselves by. Linux's MemAvailable, and no more than the headroom of the memory cgroups
that hold the process (a container's limit less what it uses: a container's
/proc/meminfo is the host's)."""

from __future__ import annotations

import functools
from pathlib import Path

UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a number near 2**63


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), at most the cgroups' headroom; None where
    neither is known."""
    found = [n for n in (_mem_available(), cgroup_headroom_bytes()) if n is not None]
    return min(found) if found else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_headroom_bytes(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The least (limit - working set) over the memory cgroups holding this process and
    their ancestors (cgroup v2 ``memory.max``/``memory.current``, v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``, less the inactive file cache of
    ``memory.stat``); None where none sets a limit."""
    try:
        lines = membership.read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    dirs: list[tuple[Path, tuple[str, str]]] = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controllers == "" and (root / "cgroup.controllers").exists():  # v2
            dirs += _up(root, path, ("memory.max", "memory.current"))
        elif "memory" in controllers.split(","):  # v1
            dirs += _up(root / "memory", path, ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    room = [r for r in (_headroom(d, files) for d, files in dirs) if r is not None]
    return min(room) if room else None


def _up(base: Path, path: str, files: tuple[str, str]) -> list[tuple[Path, tuple[str, str]]]:
    """``base/path`` and each parent up to ``base``, those that exist (a namespaced mount
    shows the process's own cgroup as ``base``)."""
    parts = [p for p in path.strip("/").split("/") if p]
    found = []
    for n in range(len(parts), -1, -1):
        d = base.joinpath(*parts[:n])
        if d.is_dir():
            found.append((d, files))
    return found


def _headroom(d: Path, files: tuple[str, str]) -> int | None:
    """``d``'s limit less its working set: the usage less the inactive file cache, which the
    kernel reclaims before it reaches the limit (as container runtimes count it)."""
    try:
        limit = (d / files[0]).read_text(encoding="ascii").strip()
        used = int((d / files[1]).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit() or int(limit) >= UNLIMITED:
        return None
    return max(0, int(limit) - max(0, used - _inactive_file(d)))


def _inactive_file(d: Path) -> int:
    """The inactive file cache in ``d``'s memory.stat (v2 ``inactive_file``, v1
    ``total_inactive_file``), 0 where it cannot be read."""
    try:
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
        return int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return 0


@functools.cache
def available_at_start() -> int | None:
    """`available_memory_bytes` as first read in this process (before any engine loaded):
    what the memory plan and every engine's default linear backend decide by, so the line
    the server prints and what its engines do agree however many engines load after it."""
    return available_memory_bytes()
