"""KvflowHiCacheStorage: SGLang's HiCache L3 storage on a kvflow cluster.

Loaded by SGLang's dynamic backend option::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvflow",
        "module_path": "kvflow.integrations.sglang_hicache",
        "class_name": "KvflowHiCacheStorage", "interface_v1": 1,
        "kvflow_meta": "10.0.0.1:7200,10.0.0.2:7200,10.0.0.3:7200",
        "kvflow_data_dir": "/data/kvflow", "kvflow_dram_bytes": 8589934592,
        "kvflow_ssd_bytes": 137438953472, "kvflow_tenant": "default"}'

SGLang's cache controller constructs it as ``cls(storage_config, kwargs)``, then calls
``register_mem_pool_host(host_pool)`` (the member opens there: the pool fixes the namespace
and the value size; a layout kvflow cannot store bit-exact is refused there with a
ValueError, which fails SGLang's attach), then ``batch_exists`` and, from its prefetch and
backup threads, ``batch_get_v1`` / ``batch_set_v1`` (zero-copy, when the extra config has
``"interface_v1": 1``: SGLang's controller takes that path for a ``dynamic`` backend only
then) or ``batch_get`` / ``batch_set`` of flat pages (its generic path). Both paths store the
same values under the same keys, so a page written on one reads back bit-exact on the other.
Every method is thread-safe and never raises for a miss or a dead peer; a broken contract
(indices not matching the keys) is logged and fails that batch.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from kvflow.integrations.config import MemberConfig
from kvflow.integrations.member import ClusterMember, MemberCounters, Misses
from kvflow.integrations.sglang_contract import load_contract, new_storage_metrics
from kvflow.integrations.sglang_pages import (
    FlatPageOrder,
    PageGeometry,
    PageKeys,
    PoolViews,
    pool_namespace,
)

_contract = load_contract()
HiCacheStorage = _contract.HiCacheStorage

logger = logging.getLogger(__name__)


def _default_node_id(storage_config: Any) -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    rank = f"tp{storage_config.tp_rank}-pp{storage_config.pp_rank}-dp{storage_config.dp_rank}"
    return f"sglang-{host[:60]}-{rank}"


class KvflowHiCacheStorage(HiCacheStorage):  # type: ignore[misc,valid-type]
    """HiCache storage whose pages live in kvdb (see the module doc). ``kwargs``: SGLang's
    extra keyword arguments (unused)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.member_config = MemberConfig.from_mapping(
            extra,
            node_id=_default_node_id(storage_config),
            engine="memory" if extra.get("kvflow_data_dir") is None else None,
        )
        self.model = extra.get("kvflow_model")
        self.member: ClusterMember | None = None
        self.keys: PageKeys | None = None
        self.views: PoolViews | None = None
        self.flat_order: FlatPageOrder | None = None
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        self._metrics = new_storage_metrics()

    # ----------------------------------------------------------------- setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Fix the namespace and value size from the pool and join the cluster."""
        super().register_mem_pool_host(mem_pool_host)
        if self.member is not None:
            return
        geometry = PageGeometry.of_pool(mem_pool_host)
        flat_order = FlatPageOrder.of_pool(mem_pool_host, geometry)
        if flat_order is None and not self.interface_v1:
            raise ValueError(
                f"kvflow HiCache storage: layout {geometry.layout!r} has no flat data page "
                "made of whole segments, so SGLang's generic page path cannot be served "
                'bit-exact: set "interface_v1": 1 in the extra config'
            )
        self.flat_order = flat_order
        ns = pool_namespace(
            mem_pool_host, geometry, self.storage_config, self.member_config.tenant, self.model
        )
        self.keys = PageKeys(ns, geometry)
        self.views = PoolViews(mem_pool_host, geometry)
        # a miss costs SGLang a prefix recompute: a holder that does not answer in time is
        # skipped at once (Misses.RECOMPUTE)
        self.member = ClusterMember(
            self.member_config, ns, value_size=geometry.segment_bytes, misses=Misses.RECOMPUTE
        )
        self.member.register_destination(self.views.bytes)
        logger.info(
            "kvflow HiCache storage: node=%s model=%s pages of %d x %d bytes (pid %d)",
            self.member_config.node_id,
            ns.model_fingerprint,
            geometry.segments,
            geometry.segment_bytes,
            os.getpid(),
        )

    def _ready(self) -> tuple[ClusterMember, PageKeys, PoolViews]:
        if self.member is None or self.keys is None or self.views is None:
            raise RuntimeError("register_mem_pool_host must be called first")
        return self.member, self.keys, self.views

    # ----------------------------------------------------------------- v1 batch API

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages are held (every segment, here or on a live peer)."""
        member, pk, _ = self._ready()
        if not keys:
            return 0
        present = member.present(pk.flat(list(keys)))
        n = pk.geometry.segments
        for page in range(len(keys)):
            if not all(present[page * n : (page + 1) * n]):
                return page
        return len(keys)

    def _segment_views(self, keys: list[str], host_indices: Any, what: str) -> list[Any] | None:
        _, pk, views = self._ready()
        if len(host_indices) != len(keys) * pk.geometry.page_size:
            logger.error(
                "%s: %d host indices for %d pages of %d tokens",
                what,
                len(host_indices),
                len(keys),
                pk.geometry.page_size,
            )
            return None
        try:
            return views.segments(host_indices)
        except ValueError as exc:
            logger.error("%s: %s", what, exc)
            return None

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Fill the host pool pages at ``host_indices`` (page_size slots per key) with the
        pages ``keys``; per page whether all its bytes arrived (a False page holds
        unspecified bytes)."""
        member, pk, _ = self._ready()
        if not keys:
            return []
        segs = self._segment_views(keys, host_indices, "batch_get_v1")
        if segs is None:
            return [False] * len(keys)
        start = time.perf_counter()
        got = member.read_into(pk.flat(list(keys)), segs)
        n = pk.geometry.segments
        out = [all(s is not None for s in got[i * n : (i + 1) * n]) for i in range(len(keys))]
        self._record("prefetch", sum(out), time.perf_counter() - start)
        return out

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool pages at ``host_indices`` under ``keys`` (pages already held
        are not rewritten); per page whether it is held now. Segments are chained (a page's
        first segment's parent is the previous page's last) so that eviction takes the tail
        of a prefix first."""
        member, pk, _ = self._ready()
        if not keys:
            return []
        segs = self._segment_views(keys, host_indices, "batch_set_v1")
        if segs is None:
            return [False] * len(keys)
        start = time.perf_counter()
        prefix = getattr(extra_info, "prefix_keys", None) or []
        parent = pk.of(prefix[-1])[-1] if prefix else None
        out: list[bool] = []
        flat = pk.flat(list(keys))
        n = pk.geometry.segments
        for page in range(len(keys)):
            ok = True
            for s in range(n):
                key = flat[page * n + s]
                ok = member.put(key, segs[page * n + s], parent) and ok
                parent = key
            out.append(ok)
        self._record("backup", sum(out), time.perf_counter() - start)
        return out

    # ----------------------------------------------------------------- single pages

    def _check_page(self, value: Any) -> bool:
        _, pk, _ = self._ready()
        nbytes = int(value.numel() * value.element_size())
        if nbytes != pk.geometry.page_bytes() or not value.is_contiguous():
            logger.error(
                "page of %d bytes; this pool's pages are %d", nbytes, pk.geometry.page_bytes()
            )
            return False
        return True

    def _chunks(self, key: str, value: Any) -> tuple[list[bytes], list[Any]] | None:
        """The segment keys of page ``key`` and the matching byte views of ``value`` (a flat
        page as SGLang's ``get_data_page`` gives it), or None (logged) when this pool has no
        flat page order."""
        import torch

        _, pk, _ = self._ready()
        if self.flat_order is None:
            logger.error(
                "layout %r: SGLang's generic page path is not served (use interface_v1)",
                pk.geometry.layout,
            )
            return None
        flat = value.reshape(-1).view(torch.uint8).numpy()  # views, as PoolViews gives v1
        size = pk.geometry.segment_bytes
        seg_keys = pk.of(key)
        keys = [seg_keys[s] for s in self.flat_order.chunks]
        return keys, [flat[i * size : (i + 1) * size] for i in range(pk.geometry.segments)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Read page ``key`` into ``target_location`` (a contiguous CPU tensor of one page's
        bytes laid out as ``get_data_page(flat=True)``; None: a new one from the pool's
        ``get_dummy_flat_data_page``); it, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """``get`` of each page, in one read of all their segments; per page its target, or
        None (a miss, or a target of the wrong size)."""
        member, pk, views = self._ready()
        targets = list(target_locations or [None] * len(keys))
        if not keys:
            return []
        start = time.perf_counter()
        seg_keys: list[bytes] = []
        seg_views: list[Any] = []
        wanted: list[int] = []
        for i, (key, target) in enumerate(zip(keys, targets, strict=True)):
            if target is None:
                target = targets[i] = views.pool.get_dummy_flat_data_page()
            chunks = self._chunks(key, target) if self._check_page(target) else None
            if chunks is not None:
                seg_keys.extend(chunks[0])
                seg_views.extend(chunks[1])
                wanted.append(i)
        got = member.read_into(seg_keys, seg_views) if seg_keys else []
        out: list[Any] = [None] * len(keys)
        n = pk.geometry.segments
        for j, i in enumerate(wanted):
            if all(g is not None for g in got[j * n : (j + 1) * n]):
                out[i] = targets[i]
        self._record("prefetch", sum(o is not None for o in out), time.perf_counter() - start)
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one page (``value``: a contiguous CPU tensor laid out as ``get_data_page``'s
        flat page), under the same keys as ``batch_set_v1`` stores it."""
        member, pk, _ = self._ready()
        if value is None or not self._check_page(value):
            return False
        chunks = self._chunks(key, value)
        if chunks is None:
            return False
        by_key = dict(zip(*chunks, strict=True))
        ok = True
        parent = None
        for seg_key in pk.of(key):  # chained in segment order, as batch_set_v1 does
            ok = member.put(seg_key, by_key[seg_key], parent) and ok
            parent = seg_key
        return ok

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        results = [self.set(k, v) for k, v in zip(keys, values or [None] * len(keys), strict=True)]
        return all(results)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ----------------------------------------------------------------- admin and stats

    def clear(self) -> None:
        """Remove every page this process's shard holds (peers keep theirs)."""
        member, _, _ = self._ready()
        removed = member.remove_all()
        logger.info("kvflow HiCache storage: cleared %d blocks", removed)

    def _record(self, kind: str, pages: int, seconds: float) -> None:
        _, pk, _ = self._ready()
        if not self.storage_config.enable_storage_metrics or pages == 0:
            return
        gb = pages * pk.geometry.page_bytes() / 1e9
        getattr(self._metrics, f"{kind}_pgs").append(pages)
        getattr(self._metrics, f"{kind}_bandwidth").append(gb / max(seconds, 1e-9))

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and bandwidth per prefetch/backup since the last
        call) with ``kvflow_tiers``: segments served from this shard's DRAM and SSD, from
        peers, and misses, since the last call."""
        metrics, self._metrics = self._metrics, new_storage_metrics()
        counters = self.member.counters(reset=True) if self.member else MemberCounters()
        metrics.kvflow_tiers = {
            "dram": counters.dram_hits,
            "ssd": counters.ssd_hits,
            "remote": counters.remote_hits,
            "miss": counters.misses,
        }
        return metrics

    def close(self) -> None:
        if self.member is not None:
            self.member.close()


__all__ = ["HiCacheStorage", "KvflowHiCacheStorage"]
