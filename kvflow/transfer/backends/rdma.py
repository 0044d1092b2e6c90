"""The rdma backend: RDMA NICs through pyverbs (rdma-core's Python binding), an optional extra.

Status: this module detects RDMA devices for real (pyverbs device list, then an active port), and
registers itself so that ``backend_names(available_only=True)`` is truthful. The RDMA data path
(memory regions, RC queue pairs exchanged over the tcp control channel, RDMA READ/WRITE work
requests) is not written yet: none of the project's machines has an RDMA device to test it on,
and an untested verbs path would be worse than none. Constructing the backend therefore raises
BackendUnavailableError, on hosts without devices (the usual case) with that reason, and on hosts
with devices saying that the data path is missing; the engine skips it unless asked for by name.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

from kvflow.transfer.backends.base import Backend, BackendContext, TransferTask
from kvflow.transfer.errors import BackendUnavailableError
from kvflow.transfer.registry import register_backend
from kvflow.transfer.types import SegmentHandle

logger = logging.getLogger(__name__)

RDMA_SCHEME = "rdma://"


def rdma_devices() -> list[str]:
    """Names of RDMA devices with at least one active port; [] without pyverbs or devices."""
    if importlib.util.find_spec("pyverbs") is None:
        return []
    try:
        import pyverbs.device as verbs_device  # type: ignore[import-not-found]
        from pyverbs.device import Context  # type: ignore[import-not-found]
    except ImportError:
        return []
    names: list[str] = []
    try:
        for device in verbs_device.get_device_list():
            name = device.name.decode() if isinstance(device.name, bytes) else str(device.name)
            with Context(name=name) as context:
                ports = context.query_device().phys_port_cnt
                if any(context.query_port(port).state == 4 for port in range(1, ports + 1)):
                    names.append(name)  # 4 == IBV_PORT_ACTIVE
    except Exception as exc:  # pyverbs raises its own PyverbsError family
        logger.info("RDMA device probe failed: %s", exc)
        return []
    return names


@register_backend
class RdmaBackend(Backend):
    """RDMA over pyverbs; see the module docstring for what is and is not implemented."""

    name = "rdma"

    def __init__(self, context: BackendContext) -> None:
        super().__init__(context)
        devices = rdma_devices()
        if not devices:
            raise BackendUnavailableError(
                "rdma backend unavailable: pyverbs is not installed or no RDMA device has an "
                "active port on this host"
            )
        raise BackendUnavailableError(
            f"rdma backend: devices {devices} found, but the verbs data path is not implemented "
            "in this build; use the tcp backend"
        )

    @classmethod
    def available(cls) -> bool:
        return False  # becomes `bool(rdma_devices())` once the data path exists

    def handles(self, peer: str) -> bool:
        return peer.startswith(RDMA_SCHEME)

    def open_segment(self, peer: str, name: str) -> SegmentHandle:  # pragma: no cover
        raise BackendUnavailableError("rdma backend has no data path")

    def submit(self, tasks: Sequence[TransferTask]) -> None:  # pragma: no cover
        raise BackendUnavailableError("rdma backend has no data path")
