"""admin.proto loaded at run time: message classes, servicer bases, stubs, service names."""

from __future__ import annotations

from kvflow.grpc_proto import load_proto

pb2, pb2_grpc = load_proto("kvflow/kvdb/admin.proto")

ADMIN_SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["KVAdmin"].full_name
"""``kvflow.kvdb.v1.KVAdmin``: add it to the server's reflection service names."""

BLOCK_SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["BlockService"].full_name
"""``kvflow.kvdb.v1.BlockService``: add it to the server's reflection service names."""

__all__ = ["ADMIN_SERVICE_NAME", "BLOCK_SERVICE_NAME", "pb2", "pb2_grpc"]
