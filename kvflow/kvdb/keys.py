"""Block keys: a namespace and a chain of blake2b-16 digests over token ids.

Pure data, importable on its own (numpy is its only dependency). Contract:

- key(-1) = blake2b-16(namespace.canonical_bytes()) = ``namespace.root_key()``.
- key(i) = blake2b-16(key(i-1) || token ids of block i as uint32 little-endian).
- Only FULL blocks get a key; a trailing partial block is ignored.
- Never Python's ``hash()`` (salted per process).

The namespace has two identities:

- ``root_key()`` covers the tenant too, so two tenants never share (or probe) each other's blocks.
- ``fingerprint()`` covers the model fingerprint and the KV layout but NOT the tenant: it is what
  a client and a shard compare when they meet (one shard serves every tenant of one model); a
  mismatch is a ``NamespaceMismatchError``, never a silent 0% hit rate.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

BlockKey = NewType("BlockKey", bytes)
"""A 16-byte block key."""

KEY_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""KV dtypes a layout may name, with their element size in bytes."""

DEFAULT_TENANT = "default"
"""The tenant of a request (or a block) that names none."""

_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FINGERPRINT_RE = re.compile(r"[A-Za-z0-9_.:/+=-]{1,256}")
_ENCODING_TAG = b"kvflow.namespace.v1"


def check_tenant(tenant: str, what: str = "tenant") -> str:
    """``tenant`` if it is 1-64 characters of ``[A-Za-z0-9_.-]``; ValueError naming ``what``."""
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"{what} must be 1-64 characters of [A-Za-z0-9_.-], got {tenant!r:.80}")
    return tenant


def _digest(data: bytes) -> BlockKey:
    return BlockKey(hashlib.blake2b(data, digest_size=KEY_BYTES).digest())


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block's KV: ``[num_layers, 2 (k, v), num_kv_heads, block_size, head_dim]``.

    Fields: num_layers, num_kv_heads, head_dim, block_size (tokens per block), all >= 1;
    dtype, one of ``DTYPE_SIZES``. Raises ValueError naming the field.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}"
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_SIZES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The block tensor's shape: (layers, 2, kv_heads, block_size, head_dim)."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's value."""
        n = self.itemsize
        for dim in self.shape:
            n *= dim
        return n

    def canonical_bytes(self) -> bytes:
        """A fixed, versioned encoding (used in fingerprints and root keys)."""
        dtype = self.dtype.encode("ascii")
        return (
            struct.pack("<4I", self.num_layers, self.num_kv_heads, self.head_dim, self.block_size)
            + struct.pack("<B", len(dtype))
            + dtype
        )


@dataclass(frozen=True)
class Namespace:
    """Tenant + model fingerprint + KV layout: the scope of a key chain.

    tenant: 1-64 characters of ``[A-Za-z0-9_.-]``. model_fingerprint: 1-256 characters of
    ``[A-Za-z0-9_.:/+=-]`` identifying architecture, weights and dtype (the engine computes it).
    Raises ValueError naming the field.
    """

    tenant: str
    model_fingerprint: str
    layout: KVLayout

    def __post_init__(self) -> None:
        check_tenant(self.tenant, "Namespace.tenant")
        if not isinstance(self.model_fingerprint, str) or not _FINGERPRINT_RE.fullmatch(
            self.model_fingerprint
        ):
            raise ValueError(
                "Namespace.model_fingerprint must be 1-256 characters of [A-Za-z0-9_.:/+=-], "
                f"got {self.model_fingerprint!r}"
            )
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"Namespace.layout must be a KVLayout, got {type(self.layout)!r}")

    def _model_bytes(self) -> bytes:
        model = self.model_fingerprint.encode("ascii")
        return struct.pack("<H", len(model)) + model + self.layout.canonical_bytes()

    def canonical_bytes(self) -> bytes:
        """The namespace's canonical encoding (tenant included): the input of key(-1)."""
        tenant = self.tenant.encode("ascii")
        return _ENCODING_TAG + struct.pack("<B", len(tenant)) + tenant + self._model_bytes()

    def fingerprint(self) -> str:
        """32 hex characters identifying model + layout (tenant excluded); shards compare it."""
        return hashlib.blake2b(
            _ENCODING_TAG + b".model" + self._model_bytes(), digest_size=KEY_BYTES
        ).hexdigest()

    def root_key(self) -> BlockKey:
        """key(-1): blake2b-16 of the canonical encoding."""
        return _digest(self.canonical_bytes())


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as uint32 little-endian. Raises ValueError for ids outside [0, 2**32)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError("token_ids must be a flat sequence of ints")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return arr.astype("<u4").tobytes()


def next_key(prev: BlockKey, block_tokens: Sequence[int]) -> BlockKey:
    """key(i) from key(i-1) and block i's token ids."""
    if len(prev) != KEY_BYTES:
        raise ValueError(f"prev must be a {KEY_BYTES}-byte BlockKey, got {len(prev)} bytes")
    return _digest(prev + encode_tokens(block_tokens))


def block_keys(namespace: Namespace, token_ids: Sequence[int]) -> list[BlockKey]:
    """One chained key per FULL block of ``token_ids`` (a trailing partial block gets none)."""
    size = namespace.layout.block_size
    encoded = encode_tokens(token_ids)
    stride = size * 4
    keys: list[BlockKey] = []
    prev = namespace.root_key()
    for start in range(0, (len(encoded) // stride) * stride, stride):
        prev = _digest(prev + encoded[start : start + stride])
        keys.append(prev)
    return keys


_NAMED_TAG = b"kvflow.named.v1"


def named_key(namespace: Namespace, name: bytes, part: int = 0) -> BlockKey:
    """The key of a block that another engine names itself (an SGLang page hash, a Mooncake
    object key), inside ``namespace``: blake2b-16(root key ‖ tag ‖ part ‖ name). ``part``
    numbers the pieces one name is stored as (0-65535). Two namespaces (tenants, models,
    layouts) never produce the same key for the same name. Raises ValueError for a bad part."""
    return named_key_prefix(namespace, part).key(name)


class NamedKeys:
    """``named_key`` of one namespace and part, its constant prefix encoded once (for
    callers that derive a key per object on a hot path)."""

    __slots__ = ("_prefix",)

    def __init__(self, prefix: bytes) -> None:
        self._prefix = prefix

    def key(self, name: bytes) -> BlockKey:
        return _digest(self._prefix + bytes(name))


def named_key_prefix(namespace: Namespace, part: int = 0) -> NamedKeys:
    """The ``named_key`` deriver of ``namespace`` and ``part``. ValueError for a bad part."""
    if not isinstance(part, int) or not 0 <= part <= 0xFFFF:
        raise ValueError(f"part must be an int in [0, 65535], got {part!r}")
    return NamedKeys(namespace.root_key() + _NAMED_TAG + struct.pack("<H", part))
