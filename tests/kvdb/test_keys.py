from __future__ import annotations

import hashlib

import pytest

from kvflow.kvdb.keys import KVLayout, Namespace, block_keys, encode_tokens, next_key
from tests.kvdb.conftest import LAYOUT, NAMESPACE


def test_key_chain_matches_the_definition() -> None:
    tokens = list(range(10))  # block_size 4: two full blocks, 2 tokens left over
    keys = block_keys(NAMESPACE, tokens)
    assert len(keys) == 2
    root = hashlib.blake2b(NAMESPACE.canonical_bytes(), digest_size=16).digest()
    assert NAMESPACE.root_key() == root
    k0 = hashlib.blake2b(
        root + b"".join(t.to_bytes(4, "little") for t in range(4)), digest_size=16
    ).digest()
    k1 = hashlib.blake2b(
        k0 + b"".join(t.to_bytes(4, "little") for t in range(4, 8)), digest_size=16
    ).digest()
    assert keys == [k0, k1]
    assert next_key(keys[0], range(4, 8)) == k1
    assert all(len(k) == 16 for k in keys)


def test_keys_depend_on_whole_prefix_and_are_stable() -> None:
    a = block_keys(NAMESPACE, [1, 2, 3, 4, 5, 6, 7, 8])
    b = block_keys(NAMESPACE, [9, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block, different prefix
    assert a == block_keys(NAMESPACE, [1, 2, 3, 4, 5, 6, 7, 8])
    assert block_keys(NAMESPACE, [1, 2, 3]) == []


def test_tenants_share_fingerprint_but_not_keys() -> None:
    other = Namespace("tenant-b", NAMESPACE.model_fingerprint, LAYOUT)
    assert other.fingerprint() == NAMESPACE.fingerprint()
    assert other.root_key() != NAMESPACE.root_key()
    assert block_keys(other, range(4)) != block_keys(NAMESPACE, range(4))


def test_model_and_layout_change_the_fingerprint() -> None:
    fp = NAMESPACE.fingerprint()
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert Namespace("tenant-a", "other-model", LAYOUT).fingerprint() != fp
    for change in ({"block_size": 8}, {"dtype": "float16"}, {"num_layers": 3}):
        layout = KVLayout(**{**LAYOUT.__dict__, **change})
        assert Namespace("tenant-a", NAMESPACE.model_fingerprint, layout).fingerprint() != fp


def test_layout_sizes() -> None:
    assert LAYOUT.shape == (2, 2, 2, 4, 16)
    assert LAYOUT.block_nbytes == 2 * 2 * 2 * 4 * 16 * 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tenant": ""}, "tenant"),
        ({"tenant": "a b"}, "tenant"),
        ({"tenant": "x" * 65}, "tenant"),
        ({"tenant": "tenant/1"}, "tenant"),
        ({"model_fingerprint": ""}, "model_fingerprint"),
        ({"model_fingerprint": "has space"}, "model_fingerprint"),
    ],
)
def test_namespace_validation_names_the_field(kwargs: dict[str, str], field: str) -> None:
    fields = {"tenant": "t", "model_fingerprint": "m", **kwargs}
    with pytest.raises(ValueError, match=field):
        Namespace(layout=LAYOUT, **fields)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"dtype": "float64"}, "dtype"),
        ({"block_size": True}, "block_size"),
    ],
)
def test_layout_validation_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVLayout(**{**LAYOUT.__dict__, **change})  # type: ignore[arg-type]


def test_token_ids_must_fit_uint32() -> None:
    with pytest.raises(ValueError, match="token ids"):
        encode_tokens([0, 2**32])
    with pytest.raises(ValueError, match="token ids"):
        block_keys(NAMESPACE, [-1, 0, 0, 0])
    assert encode_tokens([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
