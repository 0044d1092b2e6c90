"""Load a .proto of the kvflow package at run time (no generated files in the tree).

``load_proto("kvflow/stages/api/inference.proto")`` returns ``(pb2, pb2_grpc)``: the message
classes, and the servicer base / stub / ``add_*_to_server``, as grpc_tools.protoc would have
generated them. Paths are relative to the directory that holds the ``kvflow`` package.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import grpc

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def load_proto(path: str) -> tuple[ModuleType, ModuleType]:
    # protos_and_services resolves the proto path against sys.path entries.
    if _PACKAGE_ROOT not in sys.path:
        sys.path.append(_PACKAGE_ROOT)
    return grpc.protos_and_services(path)  # type: ignore[attr-defined,no-any-return]
