"""The config family of the server roles: one frozen record per role, sharing the engine and
store fields (``EngineStoreConfig``), each field validated in ``__post_init__``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.kvdb import PeerCallBudget

DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
"""The engine dtypes (``stages/engine/precision.py:PRECISIONS`` says what each means; named here
too so that flag parsing imports no torch)."""
STORAGE_ENGINES = ("lmdb", "rocksdb", "memory")
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")
DRAM_WRITE_AHEAD_BYTES = 1 << 30
"""The default of ``EngineStoreConfig.dram_write_ahead_bytes`` (``--dram-write-ahead-mb``):
what ~20 prompts of ~500 tokens store on the default model (2.8 MiB a 64-token block)."""
"""The devices an engine runs on, named here so that flag parsing imports no torch (the
engine's `require_device` checks the same and, at start, that this machine has it)."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_or_none(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, int | float) and value > 0):
        raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")


def _model_name(name: str | None) -> None:
    if name is not None and not (0 < len(name) <= 256 and name.isprintable()):
        raise ValueError(f"served_model_name must be 1-256 printable characters, got {name!r}")


@dataclass(frozen=True, kw_only=True)
class HttpConfig:
    """The HTTP front (OpenAI-compatible and SGLang-native APIs) of a server.

    Fields:
        port: the TCP port (bound on the server's host only); 0 picks a free one.
        max_body_bytes: a request body over this is refused with 413 before it is read whole.
        max_batch: the most prompts one SGLang /generate call may carry.
        header_timeout_s: a connection whose request line and headers are not all in within
            this is closed (slow-header clients), on a new connection and between requests.
        body_timeout_s: a request body not all in within this gets 408.
        keep_alive_s: an idle keep-alive connection is closed after this.
    """

    port: int = 8000
    max_body_bytes: int = 4 << 20
    max_batch: int = 64
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port < 65536
        ):
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        _positive_int("max_body_bytes", self.max_body_bytes)
        _positive_int("max_batch", self.max_batch)
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"{name} must be a number > 0")
            _positive_or_none(name, value)


@dataclass(frozen=True, kw_only=True)
class EngineStoreConfig:
    """What every process that holds an engine and a kvdb shard is built from.

    Fields:
        model_dir: a Hugging Face model directory (config.json, model.safetensors,
            tokenizer.json). None: the small demo model under ``data_dir/models/small``.
        data_dir: root of everything persistent (shards, metadata journal, demo model).
        dtype: engine dtype (``DTYPES``; int8/int4: weight-only quantized decoder linears,
            bf16 activations and KV); block_size: tokens per KV page and cached block.
        num_pages: KV pages per engine; prefill_chunk: tokens per prefill step.
        mixed_chunk: prefill tokens of a step that also decodes (an engine that does both,
            ``--colocate``) while one prompt waits (more: ``prefill_chunk``, unless
            ``tbt_target_ms``); None: ``prefill_chunk``.
        tbt_target_ms: size that budget (at most ``mixed_chunk``) to a step of about this
            many milliseconds, from measured step times; None or 0: the fixed
            ``mixed_chunk`` (the default).
        max_batch: decode batch cap per engine.
        staging_pages: page slots of each staging area (decode: streamed KV lands there;
            prefill: reuse-load reads cached blocks there).
        kv_prefault: write ``num_pages`` KV pages (one memory-planned pool: at most 1/16 of
            the available memory) of the engine that prefills at start, as vLLM allocates its
            KV cache, so the prompts' steps take no first-use page faults
            (`build.prefill_prefault`); False: one sequence's pages at start, the rest mapped
            as first written (docs/performance.md, "The KV pool written at start").
        dram_capacity_bytes / ssd_capacity_bytes: per-shard tier capacities.
        dram_prefault: write every page of each shard's DRAM tier at start (resident at once,
            a slower start) rather than as blocks are stored: a store then copies into memory
            already mapped, ~6 GB/s here against ~1.7-1.9 GB/s into fresh pages
            (docs/performance.md, "The DRAM tier written at start").
        dram_write_ahead_bytes: while its engine is idle, map each shard's DRAM tier up to
            this far past its furthest stored block (``kvdb/dram.py``; at most the tier), so
            the next prompts' stores take no first-write page faults beside the engine; only
            once the tier holds a block, so an unused tier stays unmapped. 0: never.
        dram_write_behind: while its engine is idle, write to each shard's SSD tier the DRAM
            blocks its evictions would demote (coldest first), once the DRAM tier is half full
            (``kvdb/mover.py``, ``Shard.write_behind``), so an eviction beside the engine
            drops DRAM copies instead of writing them. False: demotions write on the
            storing thread.
        storage_engine: "lmdb", "rocksdb" or "memory" for the SSD tier; None (the default):
            the engine each shard's directory already holds, else kvdb's ``DEFAULT_ENGINE``
            (``kvdb.manifest.engine_for``).
        seed: seeds the engines.
        device: where each engine's weights, KV pages and forward passes live: "cpu" or
            "cuda[:N]" (pages are stored and streamed from a host mirror of the pool,
            `Engine.host_pool`).
    """

    model_dir: Path | None = None
    data_dir: Path = Path("data")
    dtype: str = "float32"
    block_size: int = 64
    num_pages: int = 512
    prefill_chunk: int = 1024
    mixed_chunk: int | None = None
    tbt_target_ms: float | None = None
    max_batch: int = 64
    staging_pages: int = 512
    kv_prefault: bool = True
    dram_capacity_bytes: int = 1 << 30
    ssd_capacity_bytes: int = 8 << 30
    dram_prefault: bool = False
    dram_write_ahead_bytes: int = DRAM_WRITE_AHEAD_BYTES
    dram_write_behind: bool = True
    storage_engine: str | None = None
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not (isinstance(self.device, str) and DEVICE_PATTERN.fullmatch(self.device)):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in (
            "block_size",
            "num_pages",
            "prefill_chunk",
            "max_batch",
            "staging_pages",
            "dram_capacity_bytes",
            "ssd_capacity_bytes",
        ):
            _positive_int(name, getattr(self, name))
        if self.mixed_chunk is not None:
            _positive_int("mixed_chunk", self.mixed_chunk)
        if not (
            isinstance(self.dram_write_ahead_bytes, int)
            and not isinstance(self.dram_write_ahead_bytes, bool)
            and self.dram_write_ahead_bytes >= 0
        ):
            raise ValueError(
                f"dram_write_ahead_bytes must be an int >= 0 (0: none), "
                f"got {self.dram_write_ahead_bytes!r}"
            )
        if not isinstance(self.dram_write_behind, bool):
            raise ValueError(f"dram_write_behind must be a bool, got {self.dram_write_behind!r}")
        if self.tbt_target_ms is not None and not (
            isinstance(self.tbt_target_ms, int | float)
            and not isinstance(self.tbt_target_ms, bool)
            and 0 <= self.tbt_target_ms < float("inf")
        ):
            raise ValueError(
                f"tbt_target_ms must be a number of milliseconds >= 0 (0: none), "
                f"got {self.tbt_target_ms!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.storage_engine is not None and self.storage_engine not in STORAGE_ENGINES:
            raise ValueError(
                f"storage_engine must be one of {STORAGE_ENGINES}, got {self.storage_engine!r}"
            )
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", Path(self.model_dir))


@dataclass(frozen=True, kw_only=True)
class RoutingConfig:
    """What a process that routes (the embedded server, a router) decides requests with.

    Fields:
        policy: routing policy name (see ``kvflow.router.policy_names()``).
        ttft_slo_s / tbt_slo_s: reject requests predicted to miss them (None: no SLO).
        balancing_threshold: the conductor's kvcache_balancing_threshold (ratio >= 1).
        default_max_tokens / max_tokens_limit: for requests that give none / the most allowed.
        trace_capacity: requests whose spans are kept for ``kvflow trace export``.
        seed: seeds the router's random choices.
        served_model_name: the model's name in the APIs (/v1/models, Health); None: the
            model card's (the directory's name).
        max_prompt_bytes: the largest prompt text accepted, in UTF-8 bytes, checked before it
            is tokenized (Generate, Tokenize and the HTTP routes alike).
        tenant_max_concurrency: requests one tenant may have in flight at once (None: no
            limit); the next is refused at once (RESOURCE_EXHAUSTED / HTTP 429).
        tenant_rate_per_s / tenant_burst: a token bucket per tenant: requests admitted per
            second on average, and at most ``tenant_burst`` at once (None: the rate rounded
            up, at least 1); None rate: no limit. Decided in ``api/limits.py:TenantLimits``.
        max_queued_requests / max_queued_tokens: the admission queue's bounds (requests
            waiting; their prompt + max_tokens tokens together); past either, HTTP 429 /
            RESOURCE_EXHAUSTED naming the limit (``pipeline/admission.py``).
        max_running_requests: the most requests admitted at once; fewer while the engines
            have no room (the limit adapts). queue_timeout_s: the longest one waits.
        max_upload_bytes: the largest warm-up corpus file one Submit may carry; the gRPC
            server's receive limit is the larger of it and what the prompt limit needs
            (``api/limits.py:max_message_bytes``).
    """

    policy: str = "cache-aware"
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    balancing_threshold: float = 2.0
    default_max_tokens: int = 64
    max_tokens_limit: int = 4096
    trace_capacity: int = 1024
    seed: int = 0
    served_model_name: str | None = None
    max_prompt_bytes: int = 1 << 20
    tenant_max_concurrency: int | None = None
    tenant_rate_per_s: float | None = None
    tenant_burst: int | None = None
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 22
    max_running_requests: int = 128
    queue_timeout_s: float = 300.0
    max_upload_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        _model_name(self.served_model_name)
        for name in (
            "default_max_tokens",
            "max_tokens_limit",
            "trace_capacity",
            "max_prompt_bytes",
            "max_queued_requests",
            "max_queued_tokens",
            "max_running_requests",
            "max_upload_bytes",
        ):
            _positive_int(name, getattr(self, name))
        for name in ("tenant_max_concurrency", "tenant_burst"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        rate = self.tenant_rate_per_s
        bad_rate = isinstance(rate, bool) or not isinstance(rate, int | float)
        if rate is not None and (bad_rate or not 0 < rate < float("inf")):
            raise ValueError(f"tenant_rate_per_s must be a finite number > 0 or None, got {rate!r}")
        if self.tenant_burst is not None and rate is None:
            raise ValueError("tenant_burst needs tenant_rate_per_s")
        _positive_or_none("ttft_slo_s", self.ttft_slo_s)
        _positive_or_none("tbt_slo_s", self.tbt_slo_s)
        if self.queue_timeout_s is None:
            raise ValueError("queue_timeout_s must be a number > 0")
        _positive_or_none("queue_timeout_s", self.queue_timeout_s)
        if not self.balancing_threshold >= 1.0:
            raise ValueError(f"balancing_threshold must be >= 1, got {self.balancing_threshold!r}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must be <= max_tokens_limit")


@dataclass(frozen=True, kw_only=True)
class ServeConfig(EngineStoreConfig, RoutingConfig):
    """The embedded server: N prefill and M decode instances in one process.

    Fields (besides EngineStoreConfig's and RoutingConfig's):
        num_prefill / num_decode: instances of each kind; each has its own engine.
        colocate: prefill instance i and decode instance i share ONE engine (one copy of
            the weights, every core, one step loop that mixes prefill chunks into decode
            steps) with a pool of 2 x num_pages; needs num_prefill == num_decode. The stages
            and the store are the same as disaggregated (KV still goes through kvdb).
        queue_size: bounded queue in front of each stage; a full first queue rejects with
            RESOURCE_EXHAUSTED.
        request_timeout_s: deadline of one request.
    """

    num_prefill: int = 1
    num_decode: int = 1
    colocate: bool = False
    queue_size: int = 256
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        EngineStoreConfig.__post_init__(self)
        RoutingConfig.__post_init__(self)
        for name in ("num_prefill", "num_decode", "queue_size"):
            _positive_int(name, getattr(self, name))
        _positive_or_none("request_timeout_s", self.request_timeout_s)
        if self.colocate and self.num_prefill != self.num_decode:
            raise ValueError(
                f"colocate pairs prefill and decode instances: num_prefill "
                f"({self.num_prefill}) must equal num_decode ({self.num_decode})"
            )


@dataclass(frozen=True, kw_only=True)
class NodeConfig(EngineStoreConfig):
    """One node of a multi-process cluster.

    Fields (besides EngineStoreConfig's):
        node_id: a plain name (no '|' or '/'); kind: "prefill" or "decode".
        meta: the metadata replicas' gRPC addresses.
        host: the address every listener of the node binds; port / transfer_port: 0 picks
            free ports.
        lease_timeout_s: a decode staging lease not taken by a Decode call is freed after it,
            or after the longer time its router asked for (its request's time left, up to
            ``LeaseBook.MAX_HOLD_S``).
        trace_capacity: requests whose spans the node keeps for the router's trace export.
        peer_budget: deadlines of the node's calls to other nodes (block reads, the KV
            stream into a decode node), sized to their bytes, and each peer's breaker.
    """

    node_id: str
    kind: str
    meta: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    transfer_port: int = 0
    lease_timeout_s: float = 60.0
    trace_capacity: int = 1024
    peer_budget: PeerCallBudget = field(default_factory=PeerCallBudget)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.peer_budget, PeerCallBudget):
            raise ValueError(f"peer_budget must be a PeerCallBudget, got {self.peer_budget!r}")
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be prefill or decode, got {self.kind!r}")
        if not self.node_id or "|" in self.node_id or "/" in self.node_id:
            raise ValueError(f"node_id must be a plain name, got {self.node_id!r}")
        if not self.meta:
            raise ValueError("meta: give the metadata replicas' gRPC addresses")
        _positive_or_none("lease_timeout_s", self.lease_timeout_s)


@dataclass(frozen=True, kw_only=True)
class RouterSettings(RoutingConfig):
    """The router process. ``meta``: the metadata replicas' gRPC addresses;
    ``node_dead_after_s``: a node without a heartbeat for this long is routed around and
    reaped; ``instance_wait_s``: a request that finds no healthy prefill or decode node (the
    only one is restarting) waits this long for one before it is rejected."""

    model_dir: Path
    meta: tuple[str, ...]
    node_dead_after_s: float = 5.0
    instance_wait_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.meta:
            raise ValueError("meta: give the metadata replicas' gRPC addresses")
        _positive_or_none("node_dead_after_s", self.node_dead_after_s)
        if self.instance_wait_s < 0:
            raise ValueError(f"instance_wait_s must be >= 0, got {self.instance_wait_s!r}")
