"""The gRPC inference API: inference.proto loaded at run time (no generated files in the tree).

``pb2`` holds the message classes and ``pb2_grpc`` the servicer base and stub, exactly as
``grpc_tools.protoc`` would have generated them.
"""

from __future__ import annotations

from kvflow.grpc_proto import load_proto

pb2, pb2_grpc = load_proto("kvflow/stages/api/inference.proto")
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["Inference"].full_name

__all__ = ["SERVICE_NAME", "pb2", "pb2_grpc"]
