"""Mooncake Store's Python-visible types, values checked against mooncake-transfer-engine
0.3.13.post1: ``ErrorCode`` (mooncake-store types.h), the enums ``mooncake.store`` exports
and ``ReplicateConfig`` with its defaults, ``str()`` and setter checks."""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ErrorCode(IntEnum):
    """The codes the store's methods return (negative); 0 is OK."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    NOT_SUPPORTED = -1012


class SoftPinAction(IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(IntEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(IntEnum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


_U64 = 1 << 64


class ReplicateConfig:
    """Per-write options, as Mooncake's (attributes, defaults and ``str()`` alike).

    kvflow honours ``soft_pin_action`` / ``soft_pin_ttl_ms`` (validated as Mooncake does;
    soft pins are recorded per object) and ``replica_num`` (>= 1, else INVALID_PARAMS);
    the placement fields (``preferred_segment(s)``, ``prefer_alloc_in_same_node``,
    ``group_ids``, NoF/DFS counts) are accepted and do not change where a value lives."""

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.nof_replica_num: int = 0
        self.dfs_replica_num: int = 0
        self.soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self.with_hard_pin: bool = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment: str = ""
        self.prefer_alloc_in_same_node: bool = False
        self.data_type: ObjectDataType = ObjectDataType.UNKNOWN
        self.group_ids: Any = None

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U64
        ):
            raise TypeError(
                f"soft_pin_ttl_ms must be None or an unsigned 64-bit int, got {value!r}"
            )
        self._soft_pin_ttl_ms = value

    def __str__(self) -> str:
        ttl = "default" if self._soft_pin_ttl_ms is None else str(self._soft_pin_ttl_ms)
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: "
            f"{self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, soft_pin_action: "
            f"{SoftPinAction(self.soft_pin_action).name}, soft_pin_ttl_ms: {ttl}, with_hard_pin: "
            f"{int(self.with_hard_pin)}, preferred_segments: [{', '.join(self.preferred_segments)}]"
            f", preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}], "
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}, data_type: "
            f"{ObjectDataType(self.data_type).name} }}"
        )


DEFAULT_SOFT_PIN_TTL_MS = 1_800_000  # mooncake_master --default_kv_soft_pin_ttl
MAX_SOFT_PIN_TTL_MS = 86_400_000  # mooncake_master --max_kv_soft_pin_ttl
DEFAULT_KV_LEASE_TTL_MS = 10_000  # mooncake_master --default_kv_lease_ttl (0.3.13)


def soft_pin_ms(config: ReplicateConfig) -> int | ErrorCode | None:
    """How long a write with ``config`` soft-pins its object (None: not pinned), or
    INVALID_PARAMS where Mooncake's master refuses the config: a TTL without ENABLE, a TTL
    above the maximum, or ``replica_num`` < 1."""
    if config.replica_num < 1:
        return ErrorCode.INVALID_PARAMS
    ttl = config.soft_pin_ttl_ms
    if config.soft_pin_action != SoftPinAction.ENABLE:
        return None if ttl is None else ErrorCode.INVALID_PARAMS
    if ttl is None:
        return DEFAULT_SOFT_PIN_TTL_MS
    return ttl if ttl <= MAX_SOFT_PIN_TTL_MS else ErrorCode.INVALID_PARAMS


__all__ = [
    "DEFAULT_KV_LEASE_TTL_MS",
    "DEFAULT_SOFT_PIN_TTL_MS",
    "MAX_SOFT_PIN_TTL_MS",
    "ErrorCode",
    "ObjectDataType",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "TaskStatus",
    "TaskType",
    "soft_pin_ms",
]
