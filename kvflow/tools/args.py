"""Flag groups and parsing helpers shared by the commands: one place for each.

Light on purpose (no torch, no servers): ``kvflow --help`` imports it.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from kvflow.stages.serve.colocation import COLOCATED_MIXED_CHUNK
from kvflow.stages.serve.config import (
    DRAM_WRITE_AHEAD_BYTES,
    DTYPES,
    EngineStoreConfig,
    ServeConfig,
)
from kvflow.stages.serve.ports import free_port

logger = logging.getLogger(__name__)

__all__ = ["add_engine_store_flags", "address_list", "engine_store_values", "free_port"]


def address_list(value: str, flag: str) -> tuple[str, ...]:
    """``A,B,C`` -> ("A", "B", "C"); ValueError naming ``flag`` when empty."""
    out = tuple(a.strip() for a in value.split(",") if a.strip())
    if not out:
        raise ValueError(f"{flag}: give at least one HOST:PORT")
    return out


def add_engine_store_flags(p: argparse.ArgumentParser | Any) -> None:
    """The engine and shard flags that the embedded server and a node take alike."""
    p.add_argument("--data-dir", type=Path, default=Path("data"))
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="float32, bfloat16, float16; int8/int4: weight-only quantized linears, bf16 "
        "activations and KV (docs/performance.md)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]: where the engines' weights, KV pages and forward passes live "
        "(docs/performance.md, 'On a GPU')",
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument(
        "--num-pages",
        type=int,
        help="KV pages per engine (and staging slots per instance); default: one 4096-token "
        "sequence, more when free memory allows, at most 512 (printed at start)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=ServeConfig.prefill_chunk,
        help="prompt tokens an engine computes in one step (chunked prefill); default: "
        f"{ServeConfig.prefill_chunk} (docs/performance.md, 'Step sizes')",
    )
    p.add_argument(
        "--mixed-chunk",
        type=int,
        help="rows of a step that also decodes, its prompt tokens and decode rows together "
        "(an engine that does both: --colocate); smaller bounds running streams' time "
        "between tokens; while more than one prompt waits (no --tbt-target-ms) such a step "
        "takes up to --prefill-chunk; "
        f"default: {COLOCATED_MIXED_CHUNK} colocated, else --prefill-chunk",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=EngineStoreConfig.max_batch,
        help="most running requests one engine step decodes together (vLLM's --max-num-seqs, "
        "SGLang's --max-running-requests, though more may wait prefilled: each step decodes "
        f"the least recently decoded); default: {EngineStoreConfig.max_batch} "
        "(docs/performance.md, 'A step decodes up to 64 requests')",
    )
    p.add_argument(
        "--tbt-target-ms",
        type=float,
        help="size the prompt tokens of a step that also decodes (at most --mixed-chunk) "
        "to a step of about this many ms, from measured step times (docs/performance.md); "
        "default (or 0): none, the fixed --mixed-chunk",
    )
    p.add_argument(
        "--kv-prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the prefilling engine's KV pages (--num-pages of them) at start, resident "
        "at once as vLLM allocates its KV cache, so prompts take no page faults writing their "
        "K/V; --no-kv-prefault: one sequence's pages at start, the rest as used "
        "(docs/performance.md)",
    )
    p.add_argument(
        "--dram-mb",
        type=int,
        help="DRAM tier per shard, MiB; default: a quarter of the free memory over the "
        "shards, 64-16384 each (printed)",
    )
    p.add_argument(
        "--dram-prefault",
        action="store_true",
        help="write every page of the DRAM tiers at start: resident at once and a slower "
        "start, but no page faults in the prompts' stores (docs/performance.md)",
    )
    p.add_argument(
        "--dram-write-ahead-mb",
        type=int,
        default=DRAM_WRITE_AHEAD_BYTES >> 20,
        help="while the engine is idle, map each DRAM tier up to this far past its furthest "
        "stored block, so the next prompts' stores take no first-write page faults; only "
        "once it holds a block (default: %(default)s; 0: never; docs/performance.md)",
    )
    p.add_argument(
        "--dram-write-behind",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while the engine is idle and a DRAM tier is half full, write to its SSD tier "
        "the blocks its evictions would demote, coldest first, so that evictions under load write "
        "nothing; --no-dram-write-behind: demotions write on the storing thread "
        "(docs/performance.md)",
    )
    p.add_argument(
        "--ssd-mb",
        type=int,
        help="SSD tier per shard, MiB; default: a quarter of the free disk, at most 8192",
    )
    p.add_argument(
        "--storage-engine",
        choices=["lmdb", "rocksdb"],
        help="SSD tier's engine; default: the one the data dir already holds, else lmdb",
    )
    p.add_argument("--seed", type=int, default=0)


def engine_store_values(args: argparse.Namespace, plan: Any) -> dict[str, Any]:
    """The values of ``add_engine_store_flags`` as config fields (EngineStoreConfig), the
    sizes from ``plan`` (``stages/serve/memory.py:MemoryPlan``: the flags given, the rest
    sized from the model and the machine)."""
    return {
        "data_dir": args.data_dir,
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        "num_pages": plan.num_pages,
        "staging_pages": plan.staging_pages,
        "kv_prefault": args.kv_prefault,
        "prefill_chunk": args.prefill_chunk,
        "mixed_chunk": args.mixed_chunk,
        "tbt_target_ms": args.tbt_target_ms,
        "max_batch": args.max_batch,
        "dram_capacity_bytes": plan.dram_bytes,
        "ssd_capacity_bytes": plan.ssd_bytes,
        "dram_prefault": args.dram_prefault,
        "dram_write_ahead_bytes": _write_ahead_bytes(args.dram_write_ahead_mb),
        "dram_write_behind": args.dram_write_behind,
        "storage_engine": args.storage_engine,
        "seed": args.seed,
    }


def _write_ahead_bytes(mb: int) -> int:
    """``--dram-write-ahead-mb`` in bytes; ValueError naming the flag when negative."""
    if mb < 0:
        raise ValueError(f"--dram-write-ahead-mb must be >= 0 (0: never), got {mb}")
    return mb << 20


def memory_plan(args: argparse.Namespace, model_dir: Path, engines: int, shards: int) -> Any:
    """The process's ``MemoryPlan`` (``stages/serve/memory.py``) for ``add_engine_store_flags``'
    sizes: given ones kept, the rest sized from ``model_dir``'s config and this machine."""
    from kvflow.stages.serve.memory import plan_for_model

    def mib(value: int | None, flag: str) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be positive, got {value}")
        return None if value is None else value << 20

    if args.num_pages is not None and args.num_pages <= 0:
        raise ValueError(f"--num-pages must be positive, got {args.num_pages}")
    return plan_for_model(
        model_dir,
        kv_prefault=args.kv_prefault,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        engines=engines,
        shards=shards,
        data_dir=args.data_dir,
        num_pages=args.num_pages,
        dram_bytes=mib(args.dram_mb, "--dram-mb"),
        ssd_bytes=mib(args.ssd_mb, "--ssd-mb"),
    )


def add_security_flags(p: argparse.ArgumentParser | Any) -> None:
    """The cluster secret and the API keys (docs/security.md)."""
    p.add_argument(
        "--cluster-secret-file",
        type=Path,
        help="the cluster's secret (a file, chmod 600); default: $KVFLOW_CLUSTER_SECRET_FILE, "
        "else DATA_DIR/cluster.secret (generated on first start unless the role joins peers "
        "beyond loopback)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve the inference API beyond loopback without API keys (logged as a warning)",
    )
    p.add_argument("--api-key", help="require this key (Bearer) from clients: one admin key")
    p.add_argument(
        "--api-key-file", type=Path, help="keys of clients: lines 'KEY TENANT user|admin'"
    )
    add_tls_flags(p, server=True)


def add_tls_flags(p: argparse.ArgumentParser | Any, *, server: bool) -> None:
    """TLS (``kvflow/security/tls.py``): ``--tls-ca`` for a client; with ``server``, the
    certificate and key its own ports serve with too."""
    if server:
        p.add_argument(
            "--tls-cert", type=Path, help="serve gRPC and HTTP with TLS: this certificate (PEM)"
        )
        p.add_argument("--tls-key", type=Path, help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-ca",
        type=Path,
        help="connect to kvflow servers with TLS, verified against this CA (PEM); "
        "default: $KVFLOW_TLS_CA_FILE",
    )


def apply_tls(args: argparse.Namespace) -> None:
    """Make the ``add_tls_flags`` files this process's TLS settings (the environment
    variables ``kvflow.security.tls.process_tls`` reads, inherited by children); ValueError
    naming a file that is missing, unreadable or not PEM."""
    from kvflow.security.tls import TlsSettings, process_tls

    given = TlsSettings(
        getattr(args, "tls_cert", None), getattr(args, "tls_key", None), args.tls_ca
    )
    given.check()
    os.environ.update(given.env())
    process_tls().check()  # the variables set before this process started, too


def apply_cluster_secret(
    args: argparse.Namespace, role: str, binds: tuple[str, ...] = (), peers: tuple[str, ...] = ()
) -> None:
    """Give this process its cluster secret by the one rule of
    ``kvflow.security.bootstrap`` (given, environment, data dir, else generated unless the
    role joins peers beyond loopback) and make it the secret its children inherit;
    ValueError (or OSError) saying which flag or file to pass."""
    from kvflow.security.bootstrap import install_secret, resolve_secret

    data_dir = Path(getattr(args, "data_dir", None) or "data")
    given = getattr(args, "cluster_secret_file", None)
    install_secret(resolve_secret(role, data_dir, given, binds, peers))


def check_api_exposure(args: argparse.Namespace) -> None:
    """An inference API (gRPC, HTTP) beyond loopback needs API keys unless ``--insecure``
    is given, which logs a warning; ValueError saying what to pass."""
    from kvflow.security.bootstrap import is_loopback

    if is_loopback(args.host) or getattr(args, "api_key", None) or args.api_key_file:
        return
    if not getattr(args, "insecure", False):
        raise ValueError(
            f"--host {args.host} serves the inference API beyond loopback without API keys: "
            "pass --api-key or --api-key-file (or --insecure to serve it open)"
        )
    logger.warning(
        "--insecure: the inference API on %s accepts every caller (no API keys)", args.host
    )


def authenticator_from_args(args: argparse.Namespace) -> Any:
    """The inference server's Authenticator from ``--api-key`` / ``--api-key-file``."""
    from kvflow.security import process_secret
    from kvflow.stages.api.auth import ApiKeys, Authenticator

    if getattr(args, "api_key", None) and getattr(args, "api_key_file", None):
        raise ValueError("--api-key, --api-key-file: give one of them")
    keys = None
    if getattr(args, "api_key", None):
        keys = ApiKeys.single(args.api_key)
    elif getattr(args, "api_key_file", None):
        keys = ApiKeys.load(args.api_key_file)
    return Authenticator(keys, process_secret())
