"""WarmTarget: what a warm-up job needs from the process it runs in (the embedded server or
a cluster router). The composition roots implement it (serve/warmup.py); the runner and the
coverage report see nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvflow.kvdb import Namespace
from kvflow.stages.state import GenerateState
from kvflow.stages.warmup.materialize import Materializer


class WarmTarget(Protocol):
    """Every method may be called from the event loop; blocking ones say so."""

    block_size: int
    block_nbytes: int
    max_model_len: int
    supports_pins: bool

    def namespace(self, tenant: str) -> Namespace: ...

    def materializer(self) -> Materializer: ...

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` cached on some prefill instance (blocking: may ask the metadata)."""
        ...

    def holders(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """Per key: holder node -> tier name (blocking: reads the metadata)."""
        ...

    def replica_target(self, key: bytes) -> int: ...

    def set_replica_target(self, keys: Sequence[bytes], n: int) -> None:
        """Blocking: one metadata write per key."""
        ...

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float) -> Any:
        """Blocking. Pin ``keys`` where they are held for ``ttl_s``; returns what ``unpin``
        takes (the manager calls it when the TTL lapses or at stop; a target whose pins
        expire by themselves makes it a no-op)."""
        ...

    def unpin(self, token: Any) -> None: ...

    def prefill_slots(self) -> int:
        """How many segments may run at once: the healthy prefill instances (at least 1)."""
        ...

    def online_busy(self, warm_in_flight: int) -> bool:
        """Whether online requests are running or queued (the pipeline holds more than the
        job's ``warm_in_flight`` requests, or a node reports load from elsewhere)."""
        ...

    def submit(self, request_id: str, state: GenerateState) -> Any:
        """Submit to the pipeline; the handle has ``result()`` and ``cancel(reason)``."""
        ...

    def predict_prefill_s(self, prompt_len: int, reused_tokens: int) -> float: ...
