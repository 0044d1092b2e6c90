"""kvflow's Mooncake Store API against the REAL Mooncake (mooncake-transfer-engine wheel, its
``mooncake_master`` on 127.0.0.1): the same calls on both, the same return codes and bytes.

Seeded generated sequences (put/upsert/get/batch/exists/remove/tensors/pins/parts/ranges,
values 0 B - 8 MiB; several concurrent clients), plus the behaviours Mooncake's own
mooncake-wheel/tests/test_distributed_object_store.py checks. Skips only where the wheel
cannot be imported (``make`` installs it with the ``mooncake`` extra)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow.integrations import mooncake as kv

pytestmark = pytest.mark.mooncake_diff

try:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import mooncake.store as mc
except Exception as exc:  # ImportError, or OSError for a missing libibverbs
    pytest.skip(
        f"the Mooncake wheel cannot be imported ({exc}); install it with "
        "`pip install -c constraints.txt -e .[mooncake]` (needs libibverbs1)",
        allow_module_level=True,
    )

torch = pytest.importorskip("torch")

LEASE_MS = 60_000  # longer than any test: a read leases an object for the whole test
BUF = 9 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Master:
    """A real mooncake_master on 127.0.0.1 with its built-in HTTP metadata server."""

    def __init__(self, tmp: Path, lease: str) -> None:
        self.rpc, self.http = _free_port(), _free_port()
        binary = Path(mc.__file__).parent / "mooncake_master"
        self.log = (tmp / f"master-{self.rpc}.log").open("w")
        self.proc = subprocess.Popen(
            [
                str(binary),
                f"--rpc_port={self.rpc}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http}",
                f"--metrics_port={_free_port()}",
                f"--default_kv_lease_ttl={lease}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.http), 0.5).close()
                socket.create_connection(("127.0.0.1", self.rpc), 0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not start (log: {self.log.name})")

    def client(self, segment: int = 64 << 20, local: int = 32 << 20) -> Any:
        store = mc.MooncakeDistributedStore()
        meta = f"http://127.0.0.1:{self.http}/metadata"
        rc = store.setup("127.0.0.1", meta, segment, local, "tcp", "", f"127.0.0.1:{self.rpc}")
        assert rc == 0, f"real Mooncake setup returned {rc}"
        return store

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def kv_client(lease_ms: int = LEASE_MS, local: int = 32 << 20) -> kv.MooncakeDistributedStore:
    store = kv.MooncakeDistributedStore()
    config = {
        "local_hostname": "127.0.0.1",
        "metadata_server": "embedded",
        "global_segment_size": "256MB",
        "local_buffer_size": local,
        "kvflow_kv_lease_ttl": lease_ms,
    }
    assert store.setup(config) == 0
    return store


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    m = Master(tmp_path_factory.mktemp("mooncake"), str(LEASE_MS))
    yield m
    m.stop()


class Side:
    """One store with a registered scratch buffer (for the zero-copy calls)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.buf = np.zeros(BUF, dtype=np.uint8)
        self.ptr = int(self.buf.ctypes.data)
        assert store.register_buffer(self.ptr, BUF) == 0

    def close(self) -> None:
        self.store.unregister_buffer(self.ptr)
        self.store.close()


def norm(value: Any) -> Any:
    """Comparable form: buffers as bytes, tensors as (dtype, shape, bytes)."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, list | tuple):
        return [norm(v) for v in value]
    if value is None or isinstance(value, int | str | bytes):
        return value
    if isinstance(value, dict):
        return {k: norm(v) for k, v in value.items()}
    return bytes(value)  # BufferHandle


Op = Callable[[Side], Any]


def same(real: Side, ours: Side, what: str, op: Op, scratch: int = 0) -> Any:
    """Run ``op`` on both sides; the results (and ``scratch`` bytes of the buffers) match."""
    got_real, got_ours = norm(op(real)), norm(op(ours))
    assert got_ours == got_real, (
        f"{what}: kvflow {str(got_ours)[:300]} != Mooncake {str(got_real)[:300]}"
    )
    if scratch:
        assert np.array_equal(ours.buf[:scratch], real.buf[:scratch]), (
            f"{what}: buffer bytes differ"
        )
    return got_real


SIZES = [0, 1, 7, 100, 4096, 65536, 300_000, 1 << 20, 8 << 20]
WEIGHTS = [2, 4, 3, 6, 6, 5, 3, 2, 1]


def pin_config(rng: random.Random, mod: Any) -> Any:
    """A ReplicateConfig of ``mod``: default, or a soft-pin choice (some invalid)."""
    config = mod.ReplicateConfig()
    choice = rng.randrange(6)
    if choice == 1:
        config.soft_pin_action = mod.SoftPinAction.ENABLE
    elif choice == 2:
        config.soft_pin_action = mod.SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = rng.choice([0, 1000, 10**12])
    elif choice == 3:
        config.soft_pin_ttl_ms = 1000  # a TTL without ENABLE: INVALID_PARAMS
    elif choice == 4:
        config.soft_pin_action = mod.SoftPinAction.DISABLE
    elif choice == 5:
        config.with_hard_pin = True
    return config


def mod_of(side: Side, real: Side) -> Any:
    """The module whose types ``side``'s store takes."""
    return mc if side is real else kv


def run_sequence(real: Side, ours: Side, seed: int, steps: int, prefix: str) -> None:
    """A seeded sequence of operations, each compared as it runs."""
    rng = random.Random(seed)
    keys = [f"{prefix}-{i}" for i in range(12)]
    data = np.random.default_rng(seed).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()

    def value() -> bytes:
        size = rng.choices(SIZES, WEIGHTS)[0]
        at = rng.randrange(len(data) - size + 1)
        return data[at : at + size]

    big_left = [6]  # 8 MiB values: bounded so neither store nears its capacity
    for step in range(steps):
        one_op(real, ours, rng, keys, value, big_left, f"seed {seed} step {step}")


def one_op(
    real: Side, ours: Side, rng: random.Random, keys: list[str], value: Callable[[], bytes],
    big_left: list[int], label: str,
) -> None:  # fmt: skip
    """One generated operation (or two, reading back), compared."""
    op = rng.randrange(22)
    key = rng.choice(keys)
    v = value()
    if len(v) == 8 << 20:
        if big_left[0] <= 0:
            v = v[:4096]
        big_left[0] -= 1
    what = f"{label} op {op} key {key} size {len(v)}"
    seed_cfg = rng.random()
    if op in (0, 1):
        same(real, ours, what + " put", lambda s: s.store.put(key, v))
    elif op == 2:
        same(real, ours, what + " upsert", lambda s: s.store.upsert(key, v))
    elif op == 3:
        same(
            real, ours, what + " put+pins",
            lambda s: s.store.put(key, v, pin_config(random.Random(seed_cfg), mod_of(s, real))),
        )  # fmt: skip
    elif op == 4:
        same(
            real, ours, what + " upsert+pins",
            lambda s: s.store.upsert(key, v, pin_config(random.Random(seed_cfg), mod_of(s, real))),
        )  # fmt: skip
    elif op in (5, 6):
        same(real, ours, what + " get", lambda s: s.store.get(key))
    elif op == 7:
        same(real, ours, what + " get_size", lambda s: s.store.get_size(key))
    elif op == 8:
        same(real, ours, what + " is_exist", lambda s: s.store.is_exist(key))
    elif op == 9:
        batch = rng.sample(keys, 4)
        same(real, ours, what + " batch_is_exist", lambda s: s.store.batch_is_exist(batch))
    elif op == 10:
        force = rng.random() < 0.4
        same(real, ours, what + " remove", lambda s: s.store.remove(key, force))
    elif op == 11:
        batch = rng.sample(keys, 3)
        vals = [value()[:100_000] for _ in batch]
        same(real, ours, what + " put_batch", lambda s: s.store.put_batch(batch, vals))
        same(real, ours, what + " get_batch", lambda s: s.store.get_batch(batch))
    elif op == 12:
        batch = rng.sample(keys, 3)
        vals = [value()[:100_000] or b"x" for _ in batch]
        same(real, ours, what + " upsert_batch", lambda s: s.store.upsert_batch(batch, vals))
    elif op == 13:
        size = rng.choice([1, 100, 65536, 1 << 20, BUF])
        same(
            real,
            ours,
            what + " get_into",
            lambda s: s.store.get_into(key, s.ptr, size),
            scratch=min(size, 1 << 20),
        )
    elif op == 14:
        batch = rng.sample(keys, 3)
        sizes = [rng.choice([10, 65536, 3 << 20]) for _ in batch]

        def bgi(s: Side, batch: list[str] = batch, sizes: list[int] = sizes) -> Any:
            ptrs = [s.ptr, s.ptr + (3 << 20), s.ptr + (6 << 20)]
            return s.store.batch_get_into(batch, ptrs, sizes)

        same(real, ours, what + " batch_get_into", bgi, scratch=9 << 20)
    elif op == 15:
        n = len(v)
        s_real, s_ours = real, ours
        s_real.buf[:n] = np.frombuffer(v, np.uint8)
        s_ours.buf[:n] = np.frombuffer(v, np.uint8)
        upsert = rng.random() < 0.5
        same(
            real, ours, what + " put_from/upsert_from",
            lambda s: (s.store.upsert_from if upsert else s.store.put_from)(key, s.ptr, n),
        )  # fmt: skip
    elif op == 16:
        same(real, ours, what + " get_buffer", lambda s: s.store.get_buffer(key))
        batch = rng.sample(keys, 3)
        same(real, ours, what + " batch_get_buffer", lambda s: s.store.batch_get_buffer(batch))
    elif op == 17:
        cut = rng.randrange(len(v) + 1)
        parts = (v[:cut], v[cut:])
        upsert = rng.random() < 0.5
        same(
            real, ours, what + " put_parts",
            lambda s: (s.store.upsert_parts if upsert else s.store.put_parts)(key, *parts),
        )  # fmt: skip
    elif op == 18:
        shape = rng.choice([(3, 4), (8,), (2, 3, 4), (64, 64)])
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
        noise = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, 65536, np.uint8)
        t = torch.from_numpy(noise)
        t = t[: int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()]
        t = t.view(dtype).reshape(shape)
        fn = rng.choice(["put_tensor", "upsert_tensor", "pub_tensor"])
        same(real, ours, what + " " + fn, lambda s: getattr(s.store, fn)(key, t))
        same(real, ours, what + " get_tensor", lambda s: s.store.get_tensor(key))
        same(real, ours, what + " get tensor bytes", lambda s: s.store.get(key))
    elif op == 19:
        batch = rng.sample(keys, 2)
        same(real, ours, what + " batch_get_tensor", lambda s: s.store.batch_get_tensor(batch))
    elif op == 20:
        batch = rng.sample(keys, 2)
        dst = [[rng.randrange(0, 4096) for _ in range(2)] for _ in batch]
        src = [[rng.randrange(0, 200) for _ in range(2)] for _ in batch]
        sizes = [[rng.randrange(0, 60) for _ in range(2)] for _ in batch]
        same(
            real, ours, what + " get_into_ranges",
            lambda s: s.store.get_into_ranges([s.ptr], [batch], [dst], [src], [sizes]),
            scratch=8192,
        )  # fmt: skip
    else:
        batch = rng.sample(keys, 3)
        force = rng.random() < 0.5
        same(real, ours, what + " batch_remove", lambda s: s.store.batch_remove(batch, force))


@pytest.fixture
def pair(master: Master) -> Iterator[tuple[Side, Side]]:
    real, ours = Side(master.client(256 << 20)), Side(kv_client())
    yield real, ours
    real.store.remove_by_regex(".*", True)
    real.close()
    ours.close()


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_generated_sequences_match(pair: tuple[Side, Side], seed: int) -> None:
    real, ours = pair
    run_sequence(real, ours, seed, 250, _prefix())


@pytest.mark.slow
def test_concurrent_clients_match(master: Master) -> None:
    """Three clients per system at once, each its own seeded sequence and key space."""
    sides = [(Side(master.client(64 << 20)), Side(kv_client())) for _ in range(3)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            run_sequence(*sides[i], seed=100 + i, steps=100, prefix=_prefix())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client did not finish in 120 s"
        assert not errors, errors[0]
    finally:
        for real, ours in sides:
            real.store.remove_by_regex(".*", True)
            real.close()
            ours.close()


def test_mooncake_wheel_behaviours(pair: tuple[Side, Side]) -> None:
    """What Mooncake's own Python tests check, on both systems."""
    real, ours = pair
    p = _prefix()
    k = f"{p}-basic"
    same(real, ours, "put", lambda s: s.store.put(k, b"Hello, World!"))
    same(real, ours, "get_size", lambda s: s.store.get_size(k))
    same(real, ours, "get", lambda s: s.store.get(k))
    same(real, ours, "re-put returns 0", lambda s: s.store.put(k, b"other value"))
    same(real, ours, "re-put keeps the value", lambda s: s.store.get(k))
    same(real, ours, "leased remove", lambda s: s.store.remove(k))
    same(real, ours, "forced remove", lambda s: s.store.remove(k, True))
    # get_into_ranges, as mooncake-wheel's test_get_into_ranges_operations
    k1, k2 = f"{p}-r1", f"{p}-r2"
    same(real, ours, "put r1", lambda s: s.store.put(k1, b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    same(real, ours, "put r2", lambda s: s.store.put(k2, b"abcdefghijklmnopqrstuvwxyz0123456789"))
    same(
        real, ours, "ranges",
        lambda s: s.store.get_into_ranges(
            [s.ptr, s.ptr + 32], [[k1, k2], [k2, k1]], [[[0, 20], [8]], [[4], [16]]],
            [[[1, 30], [2]], [[0], [10]]], [[[4, 3], [5]], [[6], [4]]],
        ),
        scratch=64,
    )  # fmt: skip
    same(
        real, ours, "ranges mismatch",
        lambda s: s.store.get_into_ranges(
            [s.ptr], [[k1, k2]], [[[0], []]], [[[0, 1], []]], [[[], []]]
        ),
    )  # fmt: skip
    same(real, ours, "ranges missing", lambda s: s.store.get_into_ranges(
        [s.ptr], [["missing-key", k1]], [[[0], [8]]], [[[0], [0]]], [[[4], [4]]]))  # fmt: skip
    same(real, ours, "ranges past the object", lambda s: s.store.get_into_ranges(
        [s.ptr], [[k1]], [[[0]]], [[[35]]], [[[4]]]))  # fmt: skip
    # soft pins (test_soft_pin_config_forwarding)
    sp = f"{p}-softpin"

    def cfg(s: Side, action: str | None, ttl: int | None) -> Any:
        mod = mc if s is real else kv
        c = mod.ReplicateConfig()
        if action:
            c.soft_pin_action = getattr(mod.SoftPinAction, action)
        c.soft_pin_ttl_ms = ttl
        return c

    same(real, ours, "pin enable", lambda s: s.store.put(sp, b"soft", cfg(s, "ENABLE", 1000)))
    same(real, ours, "pin ttl only", lambda s: s.store.upsert(sp, b"soft", cfg(s, None, 1000)))
    same(
        real,
        ours,
        "pin disable+ttl",
        lambda s: s.store.upsert(sp, b"soft", cfg(s, "DISABLE", 1000)),
    )
    same(real, ours, "upsert plain", lambda s: s.store.upsert(sp, b"soft"))
    same(real, ours, "pin disable", lambda s: s.store.upsert(sp, b"soft", cfg(s, "DISABLE", None)))
    # batch_get_into with mismatched lists, empty lists; batch_get_buffer
    same(
        real,
        ours,
        "bgi mismatch",
        lambda s: s.store.batch_get_into([k1, k2], [s.ptr] * 3, [64] * 3),
    )
    same(real, ours, "bgi empty", lambda s: s.store.batch_get_into([], [], []))
    same(real, ours, "bgb", lambda s: s.store.batch_get_buffer([k1, "non_existent_key", k2]))
    same(real, ours, "bgb empty", lambda s: s.store.batch_get_buffer([]))
    same(real, ours, "bie empty", lambda s: s.store.batch_is_exist([]))
    same(real, ours, "get_batch empty", lambda s: s.store.get_batch([]))
    # edge inputs
    same(real, ours, "empty value", lambda s: s.store.put(f"{p}-e", b""))
    same(real, ours, "empty key", lambda s: s.store.put("", b"x"))
    same(real, ours, "get empty key", lambda s: s.store.get(""))
    same(real, ours, "size empty key", lambda s: s.store.get_size(""))
    same(real, ours, "remove empty key", lambda s: s.store.remove(""))
    same(real, ours, "put_parts none", lambda s: s.store.put_parts(f"{p}-pp"))
    same(real, ours, "put_from 0", lambda s: s.store.put_from(f"{p}-pf0", s.ptr, 0))
    same(real, ours, "exists after", lambda s: s.store.batch_is_exist([f"{p}-pp", f"{p}-pf0"]))
    same(real, ours, "put_batch mismatch", lambda s: s.store.put_batch([f"{p}-x"], []))
    same(
        real,
        ours,
        "put_batch empty value",
        lambda s: s.store.put_batch([f"{p}-b1", f"{p}-b2"], [b"x", b""]),
    )
    same(real, ours, "put over local buffer", lambda s: s.store.put(f"{p}-big", bytes(33 << 20)))
    same(real, ours, "get_into 0", lambda s: s.store.get_into(k1, s.ptr, 0))
    same(real, ours, "get_into too small", lambda s: s.store.get_into(k1, s.ptr, 5))
    same(real, ours, "register twice", lambda s: s.store.register_buffer(s.ptr, 64))
    same(real, ours, "unregister unknown", lambda s: s.store.unregister_buffer(s.ptr + 1))
    same(real, ours, "regex bad", lambda s: s.store.remove_by_regex("("))
    same(real, ours, "regex leased", lambda s: s.store.remove_by_regex(f"^{p}-r"))
    same(real, ours, "regex forced", lambda s: s.store.remove_by_regex(f"^{p}-r", True))
    same(real, ours, "health", lambda s: s.store.health_check())
    same(real, ours, "multi put", lambda s: s.store.batch_put_from_multi_buffers(
        [f"{p}-mb"], [[s.ptr, s.ptr + 100]], [[3, 4]]))  # fmt: skip
    same(real, ours, "multi get", lambda s: s.store.batch_get_into_multi_buffers(
        [f"{p}-mb", f"{p}-nope"], [[s.ptr + 1000, s.ptr + 2000], [s.ptr]], [[3, 4], [5]]),
        scratch=4096)  # fmt: skip
    same(real, ours, "multi get small", lambda s: s.store.batch_get_into_multi_buffers(
        [f"{p}-mb"], [[s.ptr + 1000, s.ptr + 2000]], [[2, 2]]))  # fmt: skip
    same(real, ours, "multi get large", lambda s: s.store.batch_get_into_multi_buffers(
        [f"{p}-mb"], [[s.ptr + 1000, s.ptr + 2000]], [[10, 10]]))  # fmt: skip
    # tensors: tp shards, uneven splits, non-tensors, the CUDA path on a CPU build
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tp = f"{p}-tp"
    same(real, ours, "put_tensor_with_tp", lambda s: s.store.put_tensor_with_tp(tp, t, 0, 2, 1))
    same(real, ours, "tp shard bytes", lambda s: s.store.get_batch([f"{tp}_tp_0", f"{tp}_tp_1"]))
    same(real, ours, "get_tensor_with_tp", lambda s: s.store.get_tensor_with_tp(tp, 1, 2, 1))
    same(real, ours, "uneven tp", lambda s: s.store.put_tensor_with_tp(f"{p}-u", t, 0, 4, 1))
    same(real, ours, "not a tensor", lambda s: s.store.put_tensor(f"{p}-nt", b"abc"))
    same(
        real,
        ours,
        "0-d tensor",
        lambda s: (s.store.put_tensor(f"{p}-0d", torch.tensor(3.0)), s.store.get_tensor(f"{p}-0d")),
    )
    same(
        real,
        ours,
        "empty tensor",
        lambda s: (s.store.put_tensor(f"{p}-e0", torch.zeros(0)), s.store.get_tensor(f"{p}-e0")),
    )
    same(real, ours, "get_tensor of bytes", lambda s: s.store.get_tensor(k1))
    same(real, ours, "cuda", lambda s: s.store.get_tensor_into_cuda(tp + "_tp_0", torch.zeros(12)))
    same(
        real, ours, "get_tensor_into", lambda s: s.store.get_tensor_into(f"{tp}_tp_0", s.ptr, 4096)
    )
    same(
        real, ours, "put_tensor_from", lambda s: s.store.put_tensor_from(f"{p}-tf", s.ptr, 304 + 48)
    )
    same(real, ours, "get tf", lambda s: s.store.get_tensor(f"{p}-tf"))
    same(
        real,
        ours,
        "put_tensor_from garbage",
        lambda s: s.store.put_tensor_from(f"{p}-tg", s.ptr + 5000, 400),
    )


@pytest.mark.slow
def test_setup_config_parsing(master: Master) -> None:
    """Dict setup, human-readable sizes, refused sizes, a second setup, a bad protocol."""
    meta = f"http://127.0.0.1:{master.http}/metadata"
    base = {"local_hostname": "127.0.0.1", "metadata_server": meta,
            "master_server_addr": f"127.0.0.1:{master.rpc}"}  # fmt: skip
    cases: list[dict[str, Any]] = [
        {"global_segment_size": "16MB", "local_buffer_size": "16 MB"},
        {"global_segment_size": "50%"},
        {"global_segment_size": "1.5GB"},
        {"global_segment_size": "16M", "local_buffer_size": "16mb"},
        {"global_segment_size": "1gib"},
        {"global_segment_size": "xyz"},
        {"global_segment_size": "-1"},
        {"global_segment_size": 17 << 20},
        {},
    ]
    for extra in cases:
        codes = []
        for mod, config in ((mc, {**base, **extra}), (kv, {**base, **extra})):
            store = mod.MooncakeDistributedStore()
            codes.append(store.setup(config))
            store.close()
        assert codes[1] == codes[0], f"setup {extra}: kvflow {codes[1]} != Mooncake {codes[0]}"
    missing = {"metadata_server": meta, "master_server_addr": base["master_server_addr"]}
    assert kv.MooncakeDistributedStore().setup(missing) == mc.MooncakeDistributedStore().setup(
        missing
    )
    for mod in (mc, kv):
        s = mod.MooncakeDistributedStore()
        assert (
            s.setup("127.0.0.1", meta, 16 << 20, 16 << 20, "bogus", "", base["master_server_addr"])
            == -1
        )
        s.close()
    real, ours = master.client(16 << 20), kv_client()
    try:
        assert ours.get_hostname().startswith("127.0.0.1:")
        assert real.get_hostname().startswith("127.0.0.1:")
        # closed and set up again (Mooncake's test_client_tear_down): the objects are gone
        for store in (real, ours):
            assert store.put("teardown", b"Hello, World!") == 0
            assert store.close() == 0 and store.health_check() == 1
        assert (
            real.setup("127.0.0.1", meta, 16 << 20, 16 << 20, "tcp", "", base["master_server_addr"])
            == 0
        )
        assert ours.setup("127.0.0.1", "embedded", 16 << 20, 16 << 20, "tcp", "", "") == 0
        assert ours.get("teardown") == real.get("teardown") == b""
    finally:
        real.close()
        ours.close()


def test_replicate_config_and_names() -> None:
    """ReplicateConfig's defaults, str() and setter checks; every public name."""
    real, ours = mc.ReplicateConfig(), kv.ReplicateConfig()
    assert str(ours) == str(real)
    fields = ["replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_ttl_ms",
              "with_hard_pin", "preferred_segments", "preferred_nof_segments",
              "preferred_segment", "prefer_alloc_in_same_node", "group_ids"]  # fmt: skip
    assert [getattr(ours, f) for f in fields] == [getattr(real, f) for f in fields]
    assert int(ours.soft_pin_action) == int(real.soft_pin_action) == 0
    assert int(ours.data_type) == int(real.data_type) == 0
    for bad in (-1, 1 << 64):
        for c in (real, ours):
            with pytest.raises(TypeError):
                c.soft_pin_ttl_ms = bad
    ours.replica_num, real.replica_num = 3, 3
    ours.soft_pin_action, real.soft_pin_action = kv.SoftPinAction.ENABLE, mc.SoftPinAction.ENABLE
    ours.soft_pin_ttl_ms = real.soft_pin_ttl_ms = 5
    assert str(ours) == str(real)
    for enum in ("SoftPinAction", "ObjectDataType", "ReplicaStatus", "TaskType", "TaskStatus"):
        theirs = getattr(mc, enum).__members__
        assert {n: int(v) for n, v in getattr(kv, enum).__members__.items()} == {
            n: int(v) for n, v in theirs.items()
        }, enum
    # kvflow does not serve Mooncake's allocator, buffer-pool, NoF, Engram and parallel
    # layout classes (docs/mooncake-store.md says why); everything else is here.
    absent = {
        "BufferLease", "BufferLeaseView", "BufferPool", "Descriptor", "DiskDescriptor",
        "EngramStore", "EngramStoreConfig", "MemoryDescriptor", "MooncakeDistributedNoFRegister",
        "MooncakeHostMemAllocator", "ParallelAxis", "QueryTaskResponse", "ReadTarget",
        "RegisteredBufferLease", "RegisteredBufferLeaseView", "RegisteredBufferPool",
        "ReplicaDescriptor", "TensorParallelism", "bind_to_numa_node", "get_alloc_func_addr",
        "get_free_func_addr",
    }  # fmt: skip
    public = {n for n in dir(mc) if not n.startswith("_")}
    assert public - set(dir(kv)) == absent
    for name in public - absent:
        theirs, mine = getattr(mc, name), getattr(kv, name)
        if not isinstance(theirs, type) and hasattr(type(theirs), "__int__"):
            assert int(mine) == int(theirs), name
    methods = {n for n in dir(mc.MooncakeDistributedStore) if not n.startswith("_")}
    missing = methods - set(dir(kv.MooncakeDistributedStore))
    assert missing == {
        "batch_get_into_multi_buffer_ranges", "batch_put_from_multi_buffer_ranges",
        "batch_get_session_start", "batch_get_session_end", "batch_put_session_start",
        "batch_put_session_end", "batch_put_session_revoke", "save_tensor_to_safetensor",
        "load_tensor_from_safetensor", "batch_get_tensor_with_parallelism_into",
        "get_tensor_with_parallelism_into", "put_tensor_with_parallelism_from",
        "batch_put_tensor_with_parallelism_from", "upsert_tensor_with_parallelism_from",
        "batch_upsert_tensor_with_parallelism_from",
    }  # fmt: skip


def test_leases_expire_alike(tmp_path: Path) -> None:
    """A read leases an object for the lease TTL: remove is refused, then allowed."""
    short = Master(tmp_path, "400ms")
    real, ours = Side(short.client(16 << 20)), Side(kv_client(lease_ms=400))
    try:
        for side in (real, ours):
            assert side.store.put("lease-key", b"v") == 0
            assert side.store.remove("lease-key") == 0  # a put alone leases nothing
            assert side.store.put("lease-key", b"v") == 0
            assert side.store.get("lease-key") == b"v"
            assert side.store.remove("lease-key") == kv.OBJECT_HAS_LEASE
        deadline = time.monotonic() + 30
        codes: dict[int, int] = {}
        while time.monotonic() < deadline and set(codes.values()) != {0}:
            time.sleep(0.1)
            for i, side in enumerate((real, ours)):
                if codes.get(i) != 0:
                    codes[i] = side.store.remove("lease-key")
        assert codes == {0: 0, 1: 0}, f"leases never expired: {codes}"
    finally:
        real.close()
        ours.close()
        short.stop()
