"""Health answers for Kubernetes probes, served next to ``/metrics`` on the metrics port.

``GET /healthz`` (liveness) is 200 while the process's loop runs; ``GET /readyz`` (readiness)
is 200 only while the role serves, else 503 with a one-line reason. Each check is a callable
that returns None when healthy or the reason it is not; this module decides, per role, what
"ready" means, from the role's objects (read by attribute, so nothing here imports them):

| role | ready when |
| --- | --- |
| node | registered with the metadata group, its pipeline (engine) running, not stopping |
| meta | the replica knows a leader and has caught up (``MetadataGroup.is_ready``) |
| router, embedded | at least one healthy prefill and one healthy decode instance, not draining |

Nothing secret is in an answer: the reason names a state, never an address or a key.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Check = Callable[[], str | None]

#: The probes' paths on the metrics port.
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"

#: A loop that has not ticked for this long is stuck; liveness then fails.
LOOP_STALE_S = 30.0
LOOP_TICK_S = 1.0


def _ok() -> str | None:
    return None


@dataclass
class Health:
    """What the metrics server answers on ``/healthz`` and ``/readyz``.

    ``draining`` is set when the process starts a graceful stop: readiness fails at once
    (``draining``) while liveness stays 200, so Kubernetes takes the pod out of its
    Services without restarting it."""

    live: Check = _ok
    ready: Check = _ok
    draining: bool = field(default=False)

    def liveness(self) -> str | None:
        return self.live()

    def readiness(self) -> str | None:
        if self.draining:
            return "draining"
        return self.ready()


class LoopPulse:
    """Liveness of an asyncio loop: ``run()`` (a task on that loop) ticks every second;
    ``check()`` (any thread) fails once no tick came for ``stale_s``."""

    def __init__(
        self, stale_s: float = LOOP_STALE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._stale_s = stale_s
        self._clock = clock
        self._last = clock()

    async def run(self) -> None:
        while True:
            self._last = self._clock()
            await asyncio.sleep(LOOP_TICK_S)

    def check(self) -> str | None:
        idle = self._clock() - self._last
        if idle > self._stale_s:
            return f"event loop stalled for {idle:.0f} s"
        return None


def node_ready(node: Any, stale_s: float = 10.0) -> Check:
    """A prefill/decode node (``NodeServer``): its pipeline (engine) running, and registered
    with the metadata group: the group took its registration or a heartbeat within
    ``stale_s`` (``node.heartbeat.last_ok``; no call to the group from the probe)."""

    def check() -> str | None:
        if not node.pipeline.running:
            return "pipeline not running"
        last = node.heartbeat.last_ok
        if last is None:
            return "not registered with the metadata group"
        if time.monotonic() - last > stale_s:
            return f"no heartbeat taken by the metadata group for {stale_s:g} s"
        return None

    return check


def meta_ready(group: Any) -> Check:
    """A metadata replica (``MetadataGroup``): a leader known and this replica caught up."""

    def check() -> str | None:
        if not group.is_ready():
            return "no leader known or not caught up"
        return None

    return check


def frontend_ready(frontend: Any) -> Check:
    """A router or the embedded server: a healthy prefill and a healthy decode instance."""

    def check() -> str | None:
        if not frontend.pipeline.running:
            return "pipeline not running"
        for kind in ("prefill", "decode"):
            instances = list(getattr(frontend, kind).values())
            if not any(_healthy(i) for i in instances):
                return f"no healthy {kind} node"
        return None

    return check


def _healthy(instance: Any) -> bool:
    state = getattr(instance, "state", None)
    return bool(getattr(state, "healthy", True))
