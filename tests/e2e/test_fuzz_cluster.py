"""A bounded fuzz suite (hypothesis, derandomized) over the intra-cluster services of a real
cluster on 127.0.0.1 (1 metadata replica, 1 prefill node, 1 decode node, 1 router): the Node
service of both nodes (Prefill, Reserve + Decode + Release, Pin, ExportTrace), the kvdb
BlockService on the prefill node (Lease, Release), and the metadata service's reads.

The caller has the cluster secret: this is a confused or buggy peer, not an outsider
(``test_attack.py`` covers those). Every answer must be OK or a status that names the caller's
mistake or a legitimate refusal (never UNKNOWN or INTERNAL, which mean an unhandled exception
in the server). Afterwards the cluster still answers a request through its router, and each
node's pages, staging slots, leases and in-flight requests are back to where they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from kvflow.kvdb.proto import pb2 as kvdb_pb2
from kvflow.kvdb.proto import pb2_grpc as kvdb_pb2_grpc
from kvflow.replication.wire import pb2 as meta_pb2
from kvflow.replication.wire import pb2_grpc as meta_pb2_grpc
from kvflow.security.grpc_auth import cluster_channel
from kvflow.stages.api import node_pb2, node_pb2_grpc
from kvflow.tools.supervise import LocalCluster

from .conftest import serve_one

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLES = 80
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
REFUSALS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    # a stream target that refuses the pages (offsets out of its segment): the decode side's
    # fault, named in the details (convert.status_for), never INTERNAL
    grpc.StatusCode.ABORTED,
}
VOCAB = 320  # the tiny demo model
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
FLOATS = st.one_of(
    st.floats(-3, 3, width=32),
    st.floats(width=32),
    st.sampled_from([0.0, 1e-40, 1.0, 100.0]),
)
DOUBLES = st.one_of(st.floats(), st.sampled_from([0.0, -1.0, 1e300, 0.5]))
TEXT = st.text(max_size=40)
KEY = st.binary(min_size=16, max_size=16)
WILD_KEY = st.one_of(KEY, st.binary(max_size=40))
GOOD_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
WILD_IDS = st.one_of(
    st.lists(U32, max_size=40), st.just([]), st.lists(st.integers(0, VOCAB - 1), min_size=600)
)


def pick(draw: st.DrawFn, good: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> Any:
    """A good value three times in four: most requests pass validation and reach the stages."""
    return draw(wild if draw(st.integers(0, 3)) == 0 else good)


@st.composite
def samplings(draw: st.DrawFn) -> Any:
    s = node_pb2.Sampling(
        temperature=pick(draw, st.sampled_from([0.0, 0.7]), FLOATS),
        top_k=pick(draw, st.integers(0, 12), U32),
        top_p=pick(draw, st.sampled_from([0.0, 0.5, 1.0]), FLOATS),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=pick(
            draw, st.lists(st.integers(0, VOCAB - 1), max_size=2), st.lists(U32, max_size=4)
        ),
        repetition_penalty=pick(draw, st.sampled_from([0.0, 1.0, 1.3]), FLOATS),
        frequency_penalty=pick(draw, st.sampled_from([0.0, 0.5]), FLOATS),
        presence_penalty=pick(draw, st.sampled_from([0.0, 0.5]), FLOATS),
    )
    if draw(st.booleans()):
        s.seed = draw(U64)
    if draw(st.booleans()):
        s.logprobs = pick(draw, st.integers(0, 3), U32)
    if draw(st.booleans()):
        s.prompt_logprobs = pick(draw, st.integers(0, 3), U32)
    return s


class Cluster:
    """The running cluster and channels to its nodes and metadata, with the secret."""

    def __init__(self, local: LocalCluster) -> None:
        self.local = local
        self.channels: list[grpc.Channel] = []
        meta = self._channel(local.meta_addresses[0])
        self.meta = meta_pb2_grpc.MetadataServiceStub(meta)
        nodes = self.meta.Nodes(meta_pb2.NodesRequest(), timeout=5).nodes
        addresses = {n.node: n.address.partition("|")[0] for n in nodes}
        prefill = self._channel(addresses["prefill-0"])
        self.prefill = node_pb2_grpc.NodeStub(prefill)
        self.blocks = kvdb_pb2_grpc.BlockServiceStub(prefill)
        self.decode = node_pb2_grpc.NodeStub(self._channel(addresses["decode-0"]))
        self.baseline: dict[str, tuple[int, int, int]] = {}  # free pages, staging, active

    def _channel(self, address: str) -> grpc.Channel:
        channel = cluster_channel(address, self.local.secret)
        self.channels.append(channel)
        return channel

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


@pytest.fixture(scope="module")
def cluster(one_of_each: LocalCluster) -> Iterator[Cluster]:
    c = Cluster(one_of_each)
    serve_one(one_of_each)
    c.baseline = {"prefill": resources(c.prefill), "decode": resources(c.decode)}
    try:
        yield c
    finally:
        c.close()


def code_of(call: Callable[[], Any]) -> grpc.StatusCode:
    """The call's status code (its details go to the log of a failing example)."""
    try:
        call()
    except grpc.RpcError as err:
        event(f"status {err.code().name}")
        note(f"{err.code().name}: {err.details()}")
        return err.code()
    event("status OK")
    return grpc.StatusCode.OK


def resources(stub: Any) -> tuple[int, int, int]:
    info = stub.Info(node_pb2.InfoRequest(), timeout=5)
    return info.free_pages, info.free_staging, info.active_requests


def settle(stub: Any, want: tuple[int, int, int], timeout_s: float = 20.0) -> tuple[int, ...]:
    """The node's resources once they are back to ``want`` (released asynchronously), or what
    they are at the deadline."""
    deadline = time.monotonic() + timeout_s
    got = resources(stub)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = resources(stub)
    return got


# -- Node service -------------------------------------------------------------------------
@st.composite
def prefill_requests(draw: st.DrawFn, reserved: Any) -> Any:
    req = node_pb2.PrefillRequest(
        request_id=pick(draw, st.uuids().map(str), TEXT),
        token_ids=pick(draw, GOOD_IDS, WILD_IDS),
        tenant=pick(draw, st.sampled_from(["", "t1"]), TEXT),
        sampling=draw(samplings()),
        predicted_prefill_s=pick(draw, st.sampled_from([0.0, 0.01]), DOUBLES),
        pull_from=pick(draw, st.just(""), st.sampled_from(["prefill-0", "decode-0", "nobody"])),
        pull_start_block=pick(draw, st.just(0), U32),
        pull_num_blocks=pick(draw, st.just(0), U32),
        pulls_decided=draw(st.booleans()),
    )
    if draw(st.booleans()):
        req.max_reuse_tokens = pick(draw, st.integers(0, 64), U32)
    if reserved is not None:  # stream into a real staging lease of the decode node
        req.target_transfer_address = reserved.transfer_address
        req.target_segment = reserved.segment
        offsets = list(reserved.offsets)
        req.target_offsets.extend(pick(draw, st.just(offsets), st.lists(U64, max_size=8)))
    return req


@FUZZ
@given(data=st.data())
def test_fuzz_node_prefill(cluster: Cluster, data: st.DataObject) -> None:
    reserved = None
    if data.draw(st.booleans()):
        reserved = cluster.decode.Reserve(
            node_pb2.ReserveRequest(request_id="fuzz-reserve", num_pages=4), timeout=10
        )
    try:
        req = data.draw(prefill_requests(reserved))
        code = code_of(lambda: list(cluster.prefill.Prefill(req, timeout=60)))
    finally:
        if reserved is not None:
            cluster.decode.Release(node_pb2.ReleaseRequest(lease_id=reserved.lease_id), timeout=10)
    assert code in REFUSALS, (code, req)


@st.composite
def decode_calls(draw: st.DrawFn) -> tuple[Any, Callable[[str], Any]]:
    reserve = node_pb2.ReserveRequest(
        request_id=pick(draw, st.uuids().map(str), TEXT),
        num_pages=pick(draw, st.integers(1, 4), U32),
    )
    prompt = draw(GOOD_IDS)
    wild_lease = draw(st.one_of(st.none(), TEXT))
    token_ids = pick(draw, st.just([*prompt, 7]), WILD_IDS)
    num_prefix = pick(draw, st.just(len(prompt)), U32)
    max_tokens = pick(draw, st.integers(0, 4), st.integers(0, 2**32 - 1))
    tenant = pick(draw, st.just(""), TEXT)
    sampling = draw(samplings())

    def decode(lease_id: str) -> Any:
        return node_pb2.DecodeRequest(
            request_id=reserve.request_id,
            lease_id=lease_id if wild_lease is None else wild_lease,
            token_ids=token_ids,
            num_prefix_tokens=num_prefix,
            max_tokens=max_tokens,
            sampling=sampling,
            tenant=tenant,
        )

    return reserve, decode


@FUZZ
@given(call=decode_calls())
def test_fuzz_node_reserve_decode_release(
    cluster: Cluster, call: tuple[Any, Callable[[str], Any]]
) -> None:
    reserve, decode = call
    replies: list[Any] = []
    code = code_of(lambda: replies.append(cluster.decode.Reserve(reserve, timeout=10)))
    assert code in REFUSALS, (code, reserve)
    lease_id = replies[0].lease_id if replies else ""
    req = decode(lease_id)
    code = code_of(lambda: list(cluster.decode.Decode(req, timeout=60)))
    assert code in REFUSALS, (code, req)
    code = code_of(
        lambda: cluster.decode.Release(node_pb2.ReleaseRequest(lease_id=lease_id), timeout=10)
    )
    assert code == grpc.StatusCode.OK


@FUZZ
@given(
    keys=st.lists(WILD_KEY, max_size=6),
    ttl=st.one_of(st.sampled_from([0.05, 1.0]), DOUBLES),
    trace_ids=st.lists(TEXT, max_size=5),
)
def test_fuzz_node_pin_and_traces(
    cluster: Cluster, keys: list[bytes], ttl: float, trace_ids: list[str]
) -> None:
    pin = node_pb2.PinRequest(keys=keys, ttl_s=ttl)
    trace = node_pb2.NodeTraceRequest(request_ids=trace_ids)
    for stub in (cluster.prefill, cluster.decode):
        code = code_of(lambda s=stub: s.Pin(pin, timeout=10))
        assert code in REFUSALS, (code, keys, ttl)
        assert code_of(lambda s=stub: s.ExportTrace(trace, timeout=10)) == grpc.StatusCode.OK


def test_prefill_refusals_name_the_field(cluster: Cluster) -> None:
    """What the fuzz found, as plain cases: each was INTERNAL before (the last one only after
    the whole prefill had run); now INVALID_ARGUMENT naming the field, before any work."""
    reserved = cluster.decode.Reserve(
        node_pb2.ReserveRequest(request_id="refusals", num_pages=1), timeout=10
    )
    try:
        target = {
            "target_transfer_address": reserved.transfer_address,
            "target_segment": reserved.segment,
            "target_offsets": list(reserved.offsets),
        }
        cases = {
            "target_transfer_address": node_pb2.PrefillRequest(
                request_id="r1", token_ids=range(5, 25)
            ),
            "request_id": node_pb2.PrefillRequest(token_ids=range(5, 25), **target),
            "target_offsets": node_pb2.PrefillRequest(
                request_id="r2", token_ids=range(5, 45), **target
            ),  # 40 tokens need 3 pages of 16, the lease has 1
        }
        for field, req in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                list(cluster.prefill.Prefill(req, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert field in info.value.details()
        local = node_pb2.PrefillRequest(
            request_id="r3", token_ids=range(5, 10), target_transfer_address="local",
            target_segment=reserved.segment, target_offsets=list(reserved.offsets),
        )  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            list(cluster.prefill.Prefill(local, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not its own memory
    finally:
        cluster.decode.Release(node_pb2.ReleaseRequest(lease_id=reserved.lease_id), timeout=10)
    reserve = node_pb2.ReserveRequest(request_id="", num_pages=1)
    with pytest.raises(grpc.RpcError) as info:
        cluster.decode.Reserve(reserve, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- kvdb BlockService ----------------------------------------------------------------------
@FUZZ
@given(
    shard=st.one_of(st.just(""), TEXT),
    keys=st.lists(WILD_KEY, max_size=8),
    lease_id=U64,
)
def test_fuzz_block_service(cluster: Cluster, shard: str, keys: list[bytes], lease_id: int) -> None:
    leases: list[Any] = []
    lease = kvdb_pb2.LeaseRequest(shard=shard, keys=keys)
    code = code_of(lambda: leases.append(cluster.blocks.Lease(lease, timeout=10)))
    assert code in REFUSALS, (code, lease)
    for reply in leases:  # give back what was leased (nothing held: no lease)
        release = kvdb_pb2.ReleaseRequest(lease_id=reply.lease_id)
        assert cluster.blocks.Release(release, timeout=10).released == bool(reply.blocks)
    release = kvdb_pb2.ReleaseRequest(lease_id=lease_id)
    assert code_of(lambda: cluster.blocks.Release(release, timeout=10)) == grpc.StatusCode.OK


# -- metadata reads ---------------------------------------------------------------------------
@FUZZ
@given(
    width=st.one_of(st.just(16), st.integers(0, 64)),
    blob=st.binary(max_size=200),
    node=st.one_of(st.sampled_from(["prefill-0", "decode-0"]), TEXT),
    limit=U32,
    job=TEXT,
)
def test_fuzz_metadata_reads(
    cluster: Cluster, width: int, blob: bytes, node: str, limit: int, job: str
) -> None:
    keys = meta_pb2.KeysRequest(keys=meta_pb2.Keys(width=width, blob=blob))
    calls = [
        lambda: cluster.meta.Holders(keys, timeout=10),
        lambda: cluster.meta.ReplicaCounts(keys, timeout=10),
        lambda: cluster.meta.ReplicaTargets(keys, timeout=10),
        lambda: cluster.meta.NodeBlocks(
            meta_pb2.NodeBlocksRequest(node=node, include_keys=True), timeout=10
        ),
        lambda: cluster.meta.UnderReplicated(
            meta_pb2.UnderReplicatedRequest(limit=limit), timeout=10
        ),
        lambda: cluster.meta.JobRead(meta_pb2.JobReadRequest(job_id=job), timeout=10),
    ]
    for call in calls:
        code = code_of(call)
        assert code in REFUSALS, (code, width, len(blob), node, limit, job)


@FUZZ
@given(
    node=st.one_of(st.just("fuzz-node"), TEXT.map(lambda t: "fuzz-" + t)),
    width=st.one_of(st.just(16), st.integers(0, 64)),
    blob=st.binary(max_size=200),
    tiers=st.binary(max_size=14),
    now=st.one_of(st.none(), DOUBLES),
    target=U32,
    op=st.one_of(st.sampled_from(["create", "claim", "append", "release"]), TEXT),
    doc=st.binary(max_size=64),
    lease_s=DOUBLES,
)
def test_fuzz_metadata_writes(
    cluster: Cluster,
    node: str,
    width: int,
    blob: bytes,
    tiers: bytes,
    now: float | None,
    target: int,
    op: str,
    doc: bytes,
    lease_s: float,
) -> None:
    """Writes under node and job names no real process uses, so the cluster keeps serving."""
    keys = meta_pb2.Keys(width=width, blob=blob)
    when = {} if now is None else {"now": now}
    calls = [
        lambda: cluster.meta.RecordBatch(
            meta_pb2.RecordBatchRequest(node=node, stored=keys, stored_tiers=tiers, **when),
            timeout=10,
        ),
        lambda: cluster.meta.ReplaceHoldings(
            meta_pb2.ReplaceHoldingsRequest(node=node, holdings=keys, tiers=tiers, **when),
            timeout=10,
        ),
        lambda: cluster.meta.Heartbeat(meta_pb2.HeartbeatRequest(node=node, **when), timeout=10),
        lambda: cluster.meta.SetReplicaTarget(
            meta_pb2.SetReplicaTargetRequest(key=blob[:40], target=target, **when), timeout=10
        ),
        lambda: cluster.meta.JobWrite(
            meta_pb2.JobWriteRequest(
                op=op, job_id=node, owner=node, doc=doc, events=[doc], lease_s=lease_s, **when
            ),
            timeout=10,
        ),
    ]
    for call in calls:
        code = code_of(call)
        assert code in REFUSALS, (code, node, width, len(blob), tiers, now, target, op)


# -- afterwards ---------------------------------------------------------------------------
def test_cluster_whole_after_fuzz(cluster: Cluster) -> None:
    baseline = cluster.baseline
    serve_one(cluster.local)
    assert settle(cluster.prefill, baseline["prefill"]) == baseline["prefill"]
    assert settle(cluster.decode, baseline["decode"]) == baseline["decode"]
    for proc in cluster.local.procs.values():
        assert proc.alive(), f"{proc.name} died during the fuzz"
