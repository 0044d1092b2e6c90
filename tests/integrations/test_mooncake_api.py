"""The Mooncake Store-compatible API on its own (no Mooncake wheel needed): return codes,
bad input, re-adopted objects, two cluster members. test_mooncake_differential.py compares
every behaviour with the real Mooncake."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvflow.integrations.mooncake import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from kvflow.integrations.mooncake_setup import parse_size
from tests.integrations.test_sglang_cluster import meta  # noqa: F401 - fixture


@pytest.fixture
def store() -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "embedded", 8 << 20, 1 << 20, "tcp", "", "") == 0
    yield s
    assert s.close() == 0


def test_setup_positional_and_dict_and_bad_input() -> None:
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "embedded"}) == 0
    assert s.setup("127.0.0.1", "embedded") == INTERNAL_ERROR  # already set up
    assert s.get_hostname() == "127.0.0.1:0" and s.health_check() == 0
    s.close()
    assert s.health_check() == 1
    assert (
        MooncakeDistributedStore().setup("127.0.0.1", "embedded", protocol="rdma") == INTERNAL_ERROR
    )
    bad = MooncakeDistributedStore()
    base = {"local_hostname": "h", "metadata_server": "embedded"}
    assert bad.setup({**base, "kvflow_tenant": "no spaces"}) == INVALID_PARAMS
    assert bad.setup({**base, "kvflow_bogus": 1}) == INVALID_PARAMS
    assert bad.setup({**base, "global_segment_size": "50%"}) == INVALID_PARAMS
    assert bad.setup({**base, "kvflow_kv_lease_ttl": "soon"}) == INVALID_PARAMS
    assert bad.setup({"metadata_server": "embedded"}) == INVALID_PARAMS  # no local_hostname
    assert bad.setup("h", "embedded", "lots") == INVALID_PARAMS  # sizes are never raised on
    assert [parse_size(v) for v in ("16MB", "16 MB", "1.5GB", "16m", "7", 5, "1GiB", "50%")] == [
        16 << 20, 16 << 20, 3 << 29, 16 << 20, 7, 5, None, None,
    ]  # fmt: skip


def test_put_get_exist_size_remove(store: MooncakeDistributedStore) -> None:
    assert store.put("hello", b"Hello, Mooncake Store!") == 0
    assert store.put("hello", b"other") == 0  # as Mooncake: succeeds, changes nothing
    assert store.get("hello") == b"Hello, Mooncake Store!"
    assert store.get("missing") == b""
    assert store.is_exist("hello") == 1 and store.is_exist("missing") == 0
    assert store.is_exist("") == 0
    assert store.get_size("hello") == 22 and store.get_size("missing") == OBJECT_NOT_FOUND
    assert store.put("", b"x") == INVALID_PARAMS
    assert store.put("empty", b"") == INVALID_PARAMS
    with pytest.raises(TypeError):
        store.put("notbytes", 12345)  # type: ignore[arg-type]
    assert store.put("big", bytes((1 << 20) + 1)) == INVALID_PARAMS  # over local_buffer_size
    assert store.remove("hello") == OBJECT_HAS_LEASE  # read just now
    assert store.remove("hello", force=True) == 0
    assert store.remove("hello") == OBJECT_NOT_FOUND
    assert store.get("hello") == b""
    assert store.upsert("u", b"one") == 0 and store.get("u") == b"one"
    assert store.upsert("u", b"three") == 0 and store.get("u") == b"three"  # leased: still
    pin = ReplicateConfig()
    pin.soft_pin_ttl_ms = 5  # a TTL without SoftPinAction.ENABLE
    assert store.put("p", b"x", pin) == INVALID_PARAMS
    pin.soft_pin_action = SoftPinAction.ENABLE
    assert store.put("p", b"x", pin) == 0 and store.remove("p") == 0  # pins never block


def test_batches_regex_and_remove_all(store: MooncakeDistributedStore) -> None:
    keys = ["user_session_1", "user_session_2", "model_a"]
    values = [b"v1", b"value-2", b"a" * 1000]
    assert store.put_batch(keys, values) == 0
    assert store.put_batch(["x"], []) == INVALID_PARAMS
    assert store.put_batch(["model_a"], [b"dup"]) == 0
    assert store.remove_by_regex("^user_session_.*") == 2  # not read yet: no lease
    assert store.put_batch(keys[:2], values[:2]) == 0
    assert store.get_batch([*keys, "nope"]) == [*values, b""]
    assert store.batch_is_exist([*keys, "nope"]) == [1, 1, 1, 0]
    assert store.remove_by_regex("^user_session_.*") == 0  # leased by the reads
    assert store.remove_by_regex("^user_session_.*", True) == 2
    assert store.remove_by_regex("(") == INVALID_PARAMS
    assert store.batch_is_exist(keys) == [0, 0, 1]
    two = ReplicateConfig()
    two.replica_num = 2
    # one process cannot hold two replicas: refused, nothing left behind (docs/durability.md)
    assert store.put("b", b"bb", two) == NO_AVAILABLE_HANDLE
    assert store.is_exist("b") == 0
    assert store.remove_all() == 0  # model_a is leased
    assert store.remove_all(force=True) == 1
    assert store.batch_is_exist(["model_a", "b"]) == [0, 0]


def test_zero_copy_needs_registered_buffers_and_reports_sizes(
    store: MooncakeDistributedStore,
) -> None:
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(8192, dtype=np.uint8)
    sp, dp = src.ctypes.data, dst.ctypes.data
    assert store.register_buffer(sp, src.nbytes) == 0
    assert store.register_buffer(sp, src.nbytes) == INVALID_PARAMS  # twice
    assert store.register_buffer(0, 10) == INVALID_PARAMS
    assert store.put_from("k", sp, src.nbytes) == 0
    assert store.get_into("k", dp, dst.nbytes) == 4096  # unregistered: as Mooncake over tcp
    assert np.array_equal(dst[:4096], src)
    dst[:] = 0
    assert store.register_buffer(dp, dst.nbytes) == 0
    assert store.get_into("k", dp, dst.nbytes) == 4096  # a larger buffer is fine
    assert np.array_equal(dst[:4096], src)
    assert store.get_into("k", dp, 100) == INVALID_PARAMS  # too small, as Mooncake
    assert store.get_into("missing", dp, 100) == OBJECT_NOT_FOUND
    half = src.nbytes // 2
    assert store.batch_put_from(["a", "b"], [sp, sp + half], [half, half]) == [0, 0]
    assert store.batch_put_from(["a"], [sp, sp], [1]) == [INVALID_PARAMS]
    dst[:] = 0
    got = store.batch_get_into(["b", "a", "zz"], [dp, dp + half, dp + 2 * half], [half, half, half])
    assert got == [half, half, OBJECT_NOT_FOUND]
    assert np.array_equal(dst[:half], src[half:]) and np.array_equal(
        dst[half : 2 * half], src[:half]
    )
    assert store.unregister_buffer(dp) == 0 and store.unregister_buffer(dp) == INVALID_PARAMS


def test_reads_of_readopted_objects_learn_their_size(tmp_path: Path) -> None:
    """Objects this object did not put (an SSD tier re-adopted after a restart) have no size
    hint: get_into learns it (a larger buffer, a too small one) and batch reads still work."""
    config = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "embedded",
        "kvflow_data_dir": str(tmp_path),
        "kvflow_node_id": "restarted",
        "kvflow_engine": "rocksdb",
    }
    first = MooncakeDistributedStore()
    assert first.setup(config) == 0
    payload = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    assert first.put_batch(["p", "q"], [payload.tobytes(), payload[:100].tobytes()]) == 0
    assert first.close() == 0
    again = MooncakeDistributedStore()
    assert again.setup(config) == 0
    try:
        dst = np.zeros(8192, dtype=np.uint8)
        assert again.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        assert again.get_into("p", dst.ctypes.data, 4999) == INVALID_PARAMS
        got = again.batch_get_into(
            ["q", "p", "r"],
            [dst.ctypes.data, dst.ctypes.data + 100, dst.ctypes.data],
            [100, 8000, 10],
        )
        assert got == [100, 5000, OBJECT_NOT_FOUND]
        assert np.array_equal(dst[:100], payload[:100])
        assert np.array_equal(dst[100:5100], payload)
        assert again.get_size("p") == 5000 and again.get("q") == payload[:100].tobytes()
    finally:
        again.close()


@pytest.mark.slow
@pytest.mark.cluster
def test_two_members_read_each_others_objects(meta: str) -> None:  # noqa: F811
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert a.setup("127.0.0.1", meta, 8 << 20) == 0
    assert b.setup("127.0.0.1", meta, 8 << 20) == 0
    try:
        payload = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
        assert a.put("shared", payload.tobytes()) == 0
        a._member.store.flush_metadata()
        assert b.is_exist("shared") == 1 and b.get_size("shared") == payload.nbytes
        assert b.get("shared") == payload.tobytes()
        dst = np.zeros(payload.nbytes, dtype=np.uint8)
        assert b.register_buffer(dst.ctypes.data, dst.nbytes) == 0
        assert b.get_into("shared", dst.ctypes.data, dst.nbytes) == payload.nbytes
        assert np.array_equal(dst, payload)
        assert b._member.counters().remote_hits == 2
        # one batch from the peer: larger buffers, a too small one, a missing key
        assert a.put_batch(["s1", "s2"], [b"x" * 1000, b"y" * 3000]) == 0
        a._member.store.flush_metadata()
        dst[:] = 0
        base = dst.ctypes.data
        got = b.batch_get_into(
            ["s2", "nope", "s1", "shared"],
            [base, base + 4000, base + 5000, base + 7000],
            [4000, 10, 2000, 100],
        )
        assert got == [3000, OBJECT_NOT_FOUND, 1000, INVALID_PARAMS]
        assert bytes(dst[:3000]) == b"y" * 3000 and bytes(dst[5000:6000]) == b"x" * 1000
        assert not dst[7000:7100].any()  # nothing written into the too small buffer
    finally:
        a.close()
        b.close()
