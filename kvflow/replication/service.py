"""The gRPC ``MetadataService`` over one replica of the metadata group (see metadata.proto).

Each meta process serves its own :class:`MetadataGroup` replica. Writes block until this
replica applied them (a follower forwards them to the leader, pysyncobj does that), so the
server is a synchronous ``grpc.server`` on a thread pool: a blocked write holds one worker
thread, and concurrent writes are pipelined into Raft by the group.

Errors map to gRPC codes: ``TypeError``/``ValueError`` (bad input, nothing proposed) ->
INVALID_ARGUMENT; ``NotLeaderError`` -> UNAVAILABLE with the leader's Raft address in the
trailing metadata ``kvflow-leader``; ``MetadataUnavailableError`` / ``MetadataTimeoutError``
(no leader, no quorum, not committed in time, closing) -> UNAVAILABLE; any other
``ReplicationError`` -> INTERNAL. After UNAVAILABLE a write's outcome is unknown; every
command is idempotent, so clients retry.

A request without ``now`` gets the serving replica's clock (``time.time``) at arrival; the
command still carries it, so every replica applies it identically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from grpc_reflection.v1alpha import reflection

from kvflow.replication.errors import (
    MetadataTimeoutError,
    MetadataUnavailableError,
    NotLeaderError,
    ReplicationError,
)
from kvflow.replication.group import MetadataGroup
from kvflow.replication.types import NodeId
from kvflow.replication.wire import (
    GRPC_OPTIONS,
    LEADER_METADATA_KEY,
    SERVICE_NAME,
    holders_msg,
    keys_from,
    keys_msg,
    node_info_msg,
    pb2,
    pb2_grpc,
    stored_from,
)
from kvflow.security import process_secret
from kvflow.security.grpc_auth import cluster_interceptors
from kvflow.security.tls import add_port

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_WORKERS = 16
"""Worker threads of the server: the most writes one replica waits on at a time."""


class MetadataServicer(pb2_grpc.MetadataServiceServicer):  # type: ignore[misc,name-defined]
    """Serves one replica. Thread-safe (the group and its view are); holds no state of its
    own beyond the group, the advertised address and the clock."""

    def __init__(
        self,
        group: MetadataGroup,
        grpc_address: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._group = group
        self.grpc_address = grpc_address
        self._clock = clock

    # ------------------------------------------------------------------ writes

    def RecordBatch(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            stored = stored_from(
                keys_from(request.stored, "stored"), request.stored_tiers, "stored_tiers"
            )
            removed = keys_from(request.removed, "removed")
            self._group.record_batch(NodeId(request.node), stored, removed, self._now(request))
            return self._write_reply()

        return self._guard(context, call)

    def ReplaceHoldings(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            holdings = stored_from(keys_from(request.holdings, "holdings"), request.tiers, "tiers")
            self._group.replace_holdings(NodeId(request.node), holdings, self._now(request))
            return self._write_reply()

        return self._guard(context, call)

    def SetReplicaTarget(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            self._group.set_replica_target(request.key, request.target, self._now(request))
            return self._write_reply()

        return self._guard(context, call)

    def RegisterNode(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            self._group.register_node(
                NodeId(request.node), request.address, request.kind, self._now(request)
            )
            return self._write_reply()

        return self._guard(context, call)

    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            known = self._group.heartbeat(NodeId(request.node), self._now(request))
            return pb2.HeartbeatReply(known=known, commands_applied=self._applied())

        return self._guard(context, call)

    def ReapDeadNodes(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            reaped = self._group.reap_dead_nodes(self._now(request))
            return pb2.ReapDeadNodesReply(reaped=list(reaped), commands_applied=self._applied())

        return self._guard(context, call)

    def JobWrite(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            ok = self._group.job_write(
                request.op,
                request.job_id,
                request.owner,
                self._now(request),
                doc=request.doc,
                events=list(request.events),
                lease_s=request.lease_s,
            )
            return pb2.JobWriteReply(ok=ok)

        return self._guard(context, call)

    # ------------------------------------------------------------------ reads

    def JobRead(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            jobs = [
                pb2.JobRecord(
                    job_id=r.job_id,
                    doc=r.doc,
                    created_at=r.created_at,
                    owner=r.owner,
                    lease_until=r.lease_until,
                    events=list(r.events),
                )
                for r in self._group.view().jobs(request.job_id)
            ]
            return pb2.JobReadReply(jobs=jobs, now=self._clock())

        return self._guard(context, call)

    def Holders(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            keys = keys_from(request.keys, "keys")
            return holders_msg(self._group.view().holders(keys))

        return self._guard(context, call)

    def ReplicaCounts(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            keys = keys_from(request.keys, "keys")
            return pb2.CountsReply(counts=[len(h) for h in self._group.view().holders(keys)])

        return self._guard(context, call)

    def ReplicaTargets(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            view = self._group.view()
            keys = keys_from(request.keys, "keys")
            return pb2.CountsReply(counts=[view.replica_target(key) for key in keys])

        return self._guard(context, call)

    def NodeBlocks(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            view = self._group.view()
            node = NodeId(request.node)
            if request.include_keys:
                keys = view.keys_on(node)
                return pb2.NodeBlocksReply(num_blocks=len(keys), keys=keys_msg(keys))
            return pb2.NodeBlocksReply(num_blocks=view.blocks_on(node))

        return self._guard(context, call)

    def Nodes(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            return pb2.NodesReply(nodes=[node_info_msg(i) for i in self._group.view().nodes()])

        return self._guard(context, call)

    def UnderReplicated(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            limit = int(request.limit) or 100
            if limit > 100_000:
                raise ValueError(f"limit must be at most 100000, got {limit}")
            entries = [
                pb2.UnderReplicatedEntry(key=key, count=count, target=target)
                for key, count, target in self._group.view().under_replicated(limit)
            ]
            return pb2.UnderReplicatedReply(entries=entries)

        return self._guard(context, call)

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        def call() -> Any:
            group = self._group
            status = group.raft_status()
            view = group.view()
            return pb2.StatusReply(
                raft_address=group.config.self_address,
                grpc_address=self.grpc_address,
                leader=group.leader() or "",
                is_leader=group.is_leader(),
                raft_term=int(status.get("raft_term", 0)),
                commit_index=int(status.get("commit_idx", 0)),
                last_applied=int(status.get("last_applied", 0)),
                commands_applied=view.commands_applied(),
                num_blocks=view.num_blocks(),
                num_nodes=len(view.nodes()),
                partners=list(group.config.partner_addresses),
                ready=group.is_ready(),
            )

        return self._guard(context, call)

    # ------------------------------------------------------------------ internals

    def _now(self, request: Any) -> float:
        return float(request.now) if request.HasField("now") else self._clock()

    def _applied(self) -> int:
        return self._group.view().commands_applied()

    def _write_reply(self) -> Any:
        return pb2.WriteReply(commands_applied=self._applied())

    def _guard(self, context: grpc.ServicerContext, call: Callable[[], T]) -> T:
        """Run ``call``; turn its errors into gRPC status codes (see the module docstring)."""
        try:
            return call()
        except (TypeError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotLeaderError as exc:
            if exc.leader_hint:
                context.set_trailing_metadata(((LEADER_METADATA_KEY, exc.leader_hint),))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (MetadataUnavailableError, MetadataTimeoutError) as exc:
            leader = self._group.leader()
            if leader:
                context.set_trailing_metadata(((LEADER_METADATA_KEY, leader),))
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ReplicationError as exc:
            logger.warning("metadata service: %s", exc)
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        raise AssertionError("unreachable: context.abort raises")


def create_meta_server(
    group: MetadataGroup,
    host: str,
    port: int,
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> tuple[grpc.Server, int]:
    """A (not yet started) gRPC server with the metadata service over ``group`` and server
    reflection, bound to ``host:port`` (0 = any free port). Returns ``(server, bound_port)``.
    The caller starts and stops it; stopping it does not close the group."""
    if max_workers < 1:
        raise ValueError(f"max_workers: must be >= 1, got {max_workers!r}")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvflow-metarpc"),
        options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
        interceptors=cluster_interceptors(process_secret()),
    )
    servicer = MetadataServicer(group)
    pb2_grpc.add_MetadataServiceServicer_to_server(servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", None)  # TLS when configured
    if bound == 0:
        raise MetadataUnavailableError(f"cannot bind the metadata service at {host}:{port}")
    servicer.grpc_address = f"{host}:{bound}"
    return server, bound
