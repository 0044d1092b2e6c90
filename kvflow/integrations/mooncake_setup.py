"""How Mooncake's ``setup`` reads its arguments: human-readable sizes (its
``try_string_to_byte_size``: "16MB", "1.5 GB", "16M", "1024"; binary units; "50%" or "1GiB"
are refused), the config-dict form (every value read as its ``str()``), and kvflow's own
``kvflow_*`` keys."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow.integrations.mooncake_types import DEFAULT_KV_LEASE_TTL_MS

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20}
_UNITS |= {"G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_DURATION = re.compile(r"(\d+)\s*(ms|s|m|h)?")
_DURATION_MS = {"ms": 1, "": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
DEFAULT_SEGMENT = 16 << 20  # Mooncake's default global_segment_size and local_buffer_size


def parse_size(value: Any) -> int | None:
    """Bytes for an int or a size string as Mooncake reads it; None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    text = str(value).strip()
    if text == "infinite":
        return (1 << 64) - 1
    match = _NUMBER.match(text)
    if not match:
        return None
    number = float(match.group(0))
    unit = text[match.end() :].strip().upper()
    if number < 0 or unit not in _UNITS:
        return None
    return int(number * _UNITS[unit])


def parse_duration_ms(value: Any) -> int | None:
    """Milliseconds for an int or a duration string ("500", "200ms", "5s", "1m", "1h")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    match = _DURATION.fullmatch(str(value).strip())
    return None if not match else int(match.group(1)) * _DURATION_MS[match.group(2) or ""]


@dataclass(frozen=True)
class SetupArgs:
    """setup()'s arguments, parsed. ``kvflow`` holds the ``kvflow_*`` keys for the member
    (the store's own, ``kvflow_kv_lease_ttl``, taken out)."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int = DEFAULT_SEGMENT
    local_buffer_size: int = DEFAULT_SEGMENT
    protocol: str = "tcp"
    tenant_id: str = "default"
    lease_ttl_ms: int = DEFAULT_KV_LEASE_TTL_MS
    kvflow: dict[str, Any] = field(default_factory=dict)


def from_dict(config: Mapping[str, Any]) -> SetupArgs | str:
    """The dict form; a str names what is wrong (setup then returns INVALID_PARAMS)."""
    if "local_hostname" not in config or "metadata_server" not in config:
        return "local_hostname and metadata_server are required"
    sizes: dict[str, int] = {}
    for name in ("global_segment_size", "local_buffer_size"):
        raw = config.get(name, DEFAULT_SEGMENT)
        parsed = parse_size(raw if isinstance(raw, int) else str(raw))
        if parsed is None:
            return f"{name}: not a size: {raw!r} (e.g. 16777216, '16MB', '1.5 GB')"
        sizes[name] = parsed
    kvflow = {k: v for k, v in config.items() if str(k).startswith("kvflow_")}
    lease = parse_duration_ms(kvflow.pop("kvflow_kv_lease_ttl", DEFAULT_KV_LEASE_TTL_MS))
    if lease is None:
        return "kvflow_kv_lease_ttl: not a duration (e.g. 10000, '200ms', '5s')"
    return SetupArgs(
        local_hostname=str(config["local_hostname"]),
        metadata_server=str(config["metadata_server"]),
        protocol=str(config.get("protocol", "tcp")),
        tenant_id=str(config.get("tenant_id", "default")),
        lease_ttl_ms=lease,
        kvflow=kvflow,
        **sizes,
    )


__all__ = ["DEFAULT_SEGMENT", "SetupArgs", "from_dict", "parse_duration_ms", "parse_size"]
