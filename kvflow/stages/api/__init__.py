"""The gRPC inference API: inference.proto loaded at run time (no generated files in the tree).

``pb2`` holds the message classes and ``pb2_grpc`` the servicer base and stub, exactly as
``grpc_tools.protoc`` would have generated them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import grpc

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
_PROTO = "kvflow/stages/api/inference.proto"


def _load() -> tuple[ModuleType, ModuleType]:
    # protos_and_services resolves the proto path against sys.path entries.
    if _PACKAGE_ROOT not in sys.path:
        sys.path.append(_PACKAGE_ROOT)
    return grpc.protos_and_services(_PROTO)  # type: ignore[attr-defined,no-any-return]


pb2, pb2_grpc = _load()
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["Inference"].full_name

__all__ = ["SERVICE_NAME", "pb2", "pb2_grpc"]
