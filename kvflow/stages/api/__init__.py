"""The gRPC inference API: inference.proto loaded at run time (no generated files in the tree).

``pb2`` holds the message classes and ``pb2_grpc`` the servicer base and stub, exactly as
``grpc_tools.protoc`` would have generated them.
"""

from __future__ import annotations

from kvflow.grpc_proto import load_proto

pb2, pb2_grpc = load_proto("kvflow/stages/api/inference.proto")
SERVICE_NAME: str = pb2.DESCRIPTOR.services_by_name["Inference"].full_name

# The node API a router uses (kvflow serve --role node).
node_pb2, node_pb2_grpc = load_proto("kvflow/stages/api/node.proto")
NODE_SERVICE_NAME: str = node_pb2.DESCRIPTOR.services_by_name["Node"].full_name

__all__ = ["NODE_SERVICE_NAME", "SERVICE_NAME", "node_pb2", "node_pb2_grpc", "pb2", "pb2_grpc"]
