from __future__ import annotations

import numpy as np
import pytest

from kvflow.kvdb import codec
from kvflow.kvdb.allocator import ExtentAllocator
from kvflow.kvdb.errors import ChecksumError

KEY = bytes(range(100, 116))


def _bf16_like(n: int) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal(n // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


@pytest.mark.parametrize(("compress", "width"), [(False, 1), (True, 1), (True, 2)])
def test_record_roundtrip(compress: bool, width: int) -> None:
    raw = _bf16_like(1 << 16)
    parent = bytes(range(16))
    rec = codec.encode_record(
        raw,
        codec.block_checksum(KEY, parent, "acme", raw),
        parent,
        tenant="acme",
        compress=compress,
        level=3,
        shuffle_width=width,
    )
    if compress:
        assert len(rec) < raw.nbytes  # bf16 normals compress
    out = np.empty_like(raw)
    header = codec.decode_record_into(rec, out, KEY)
    assert np.array_equal(out, raw)
    assert header.parent == parent and header.raw_len == raw.nbytes
    assert header.tenant == "acme"


def test_the_owner_tenant_is_checked_like_the_rest_of_the_header() -> None:
    raw = _bf16_like(4096)
    csum = codec.block_checksum(KEY, None, "acme", raw)
    enc = {"compress": False, "level": 3, "shuffle_width": 1}
    with pytest.raises(ValueError, match="tenant"):
        codec.encode_record(raw, csum, None, tenant="no spaces", **enc)
    rec = bytearray(codec.encode_record(raw, csum, None, tenant="acme", **enc))
    assert len(rec) == codec.HEADER_BYTES + 4 + raw.nbytes
    rec[codec.HEADER_BYTES] = ord(" ")  # the tenant's first byte: no longer a tenant name
    with pytest.raises(ChecksumError, match="tenant"):
        codec.decode_header(bytes(rec))
    rec[codec.HEADER_BYTES - 1] = 200  # a tenant length past the record
    with pytest.raises(ChecksumError, match="truncated"):
        codec.decode_header(bytes(rec))


def test_shuffle_improves_bf16_ratio() -> None:
    raw = _bf16_like(1 << 18)
    plain = codec.encode_record(
        raw, 0, None, tenant="acme", compress=True, level=3, shuffle_width=1
    )
    shuffled = codec.encode_record(
        raw, 0, None, tenant="acme", compress=True, level=3, shuffle_width=2
    )
    assert len(shuffled) < len(plain)


def test_incompressible_values_are_stored_plain() -> None:
    raw = np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8)
    rec = codec.encode_record(
        raw, codec.checksum(raw), None, tenant="acme", compress=True, level=3, shuffle_width=2
    )
    assert codec.decode_header(rec).codec == codec.CODEC_NONE


@pytest.mark.parametrize("compress", [False, True])
def test_corruption_and_truncation_are_detected(compress: bool) -> None:
    raw = _bf16_like(8192)
    rec = bytearray(
        codec.encode_record(
            raw,
            codec.block_checksum(KEY, None, "acme", raw),
            None,
            tenant="acme",
            compress=compress,
            level=3,
            shuffle_width=2,
        )
    )
    out = np.empty_like(raw)
    flipped = bytearray(rec)
    flipped[-5] ^= 0x40
    with pytest.raises(ChecksumError):
        codec.decode_record_into(bytes(flipped), out, KEY)
    with pytest.raises(ChecksumError, match="truncated"):
        codec.decode_record_into(bytes(rec[:-7]), out, KEY)
    with pytest.raises(ChecksumError, match="truncated"):
        codec.decode_record_into(bytes(rec[:20]), out, KEY)
    bad_magic = b"XXXX" + bytes(rec[4:])
    with pytest.raises(ChecksumError, match="magic"):
        codec.decode_record_into(bad_magic, out, KEY)


@pytest.mark.parametrize("compress", [False, True])
def test_a_record_under_another_key_or_parent_fails_its_checksum(compress: bool) -> None:
    """The checksum covers the key and the parent: a valid record is refused elsewhere."""
    raw = _bf16_like(8192)
    parent = bytes(16 * [7])
    rec = codec.encode_record(
        raw,
        codec.block_checksum(KEY, parent, "acme", raw),
        parent,
        tenant="acme",
        compress=compress,
        level=3,
        shuffle_width=2,
    )
    out = np.empty_like(raw)
    codec.decode_record_into(rec, out, KEY)  # its own key: fine
    other = bytes(16 * [9])
    with pytest.raises(ChecksumError, match="another key"):
        codec.decode_record_into(rec, out, other)
    reparented = bytearray(rec)
    reparented[32:48] = other  # the header's parent field
    with pytest.raises(ChecksumError, match="another key"):
        codec.decode_record_into(bytes(reparented), out, KEY)


def test_block_checksum_binds_key_parent_and_tenant() -> None:
    data = b"x" * 64
    base = codec.block_checksum(KEY, None, "acme", data)
    assert base == codec.checksum(data, codec.key_seed(KEY, None, "acme"))
    assert codec.block_checksum(bytes(16), None, "acme", data) != base
    assert codec.block_checksum(KEY, bytes(range(16)), "acme", data) != base
    assert codec.block_checksum(KEY, None, "acmf", data) != base
    assert codec.checksum(data) != base


@pytest.mark.parametrize("compress", [False, True])
def test_a_record_whose_tenant_names_another_valid_tenant_fails_its_checksum(
    compress: bool,
) -> None:
    """The owner tenant is covered: a flipped bit that leaves a valid name is corruption."""
    raw = _bf16_like(8192)
    enc = {"compress": compress, "level": 3, "shuffle_width": 2}
    rec = codec.encode_record(
        raw, codec.block_checksum(KEY, None, "acme", raw), None, tenant="acme", **enc
    )
    out = np.empty_like(raw)
    assert codec.decode_record_into(rec, out, KEY).tenant == "acme"
    relabelled = bytearray(rec)
    relabelled[codec.HEADER_BYTES + 3] ^= 0x03  # "acme" -> "acmf": still a valid tenant name
    assert codec.decode_header(bytes(relabelled)).tenant == "acmf"
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        codec.decode_record_into(bytes(relabelled), out, KEY)


def test_copy_and_checksum_matches_plain_checksum() -> None:
    src = np.random.default_rng(3).integers(0, 256, 3 * 256 * 1024 + 17, dtype=np.uint8)
    dst = np.empty_like(src)
    assert codec.copy_and_checksum(dst, src) == codec.checksum(src)
    assert np.array_equal(dst, src)


def test_allocator_first_fit_and_coalescing() -> None:
    alloc = ExtentAllocator(1024, alignment=64)
    offsets = [alloc.allocate(100) for _ in range(8)]  # 128 bytes each
    assert offsets == [0, 128, 256, 384, 512, 640, 768, 896]
    assert alloc.allocate(1) is None
    alloc.free(128, 100)
    alloc.free(384, 100)
    assert alloc.allocate(200) is None  # two separate 128-byte holes
    alloc.free(256, 100)  # merges 128..512 into one hole
    assert alloc.free_extents() == [(128, 384)]
    assert alloc.allocate(300) == 128
    with pytest.raises(ValueError, match="double free"):
        alloc.free(0, 10)
        alloc.free(0, 10)
    assert alloc.used == alloc.capacity - sum(s for _, s in alloc.free_extents())
