"""Running a LocalCluster with this test process as one of its members."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvflow.security import SECRET_FILE_ENV
from kvflow.tools.supervise import LocalCluster


@contextmanager
def running_as_member(cluster: LocalCluster, timeout_s: float) -> Iterator[LocalCluster]:
    """Start ``cluster`` and, while it runs, give this process its secret (the environment
    variable ``process_secret`` reads), so the test reads the metadata and calls nodes as a
    member. Stops every process (paused ones too) and takes the variable back at the end."""
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_FILE_ENV, str(cluster.secret_file))
    try:
        cluster.start(timeout_s=timeout_s)
        yield cluster
    finally:
        cluster.stop()
        patch.undo()


# A shared cluster back to full strength before a test: restarting a decode node takes about
# 15 s on a loaded 2-core machine; the deadline is generous.
HEAL_S = 180.0


def heal(cluster: LocalCluster) -> None:
    """Start again whatever an earlier test killed (or what crashed) in a module's shared
    ``cluster`` and wait until it serves: each test starts on a whole cluster, and one
    test's failure does not cascade into the next. Cheap when nothing is down."""
    cluster.heal(HEAL_S)
