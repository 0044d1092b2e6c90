"""Benchmark of one node's kvdb shard: DRAM and SSD tiers against memcpy and raw engine gets.

For each value size (64 KiB, 1 MiB, 4 MiB by default) it measures, on seeded random values:

- memcpy: numpy copy from a preallocated source pool into preallocated destination buffers
  (the same access pattern as a DRAM get_into);
- DRAM tier: put, get_into, batch put, batch get_into (memory engine, no SSD);
- SSD tier, per engine (rocksdb, lmdb): the same four (DRAM capacity 0, so every get reads
  the engine), and the engine's own raw get of the same records;

and the zstd compression ratio (with and without byte-shuffling) on KV pages: pages exported
by the engine from a model directory (``--pages MODEL_DIR``), or seeded random bf16 tensors
shaped like KV otherwise. Every measurement is the median of ``--repeat`` passes. Prints one
summary line; ``--json PATH`` writes everything.

``--remote`` measures instead the remote read path between two processes on loopback
(RemoteClient batch get_into vs a raw socket; see ``bench_kvdb_remote``).

    .venv/bin/python -m kvflow.tools.bench.kvdb --json bench_kvdb.json
    .venv/bin/python -m kvflow.tools.bench.kvdb --remote --repeat 7 --json remote.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.kvdb import EmbeddedClient, KVLayout, Namespace, Shard, StoreConfig, block_keys, codec

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}


def _layout_for(nbytes: int) -> KVLayout:
    """A bf16 KV layout whose block is ``nbytes`` (4 kv heads, 16 tokens, head dim 64)."""
    per_layer = 2 * 4 * 16 * 64 * 2
    if nbytes % per_layer:
        raise ValueError(f"value size {nbytes} is not a multiple of {per_layer}")
    return KVLayout(nbytes // per_layer, 4, 64, 16, "bfloat16")


def _rate(nbytes: int, passes: Sequence[float]) -> dict[str, Any]:
    """GB/s of the median pass and of the best pass (the machine is shared: noise)."""
    med = statistics.median(passes)
    return {
        "gbps": nbytes / med / 1e9,
        "best_gbps": nbytes / min(passes) / 1e9,
        "seconds": list(passes),
    }


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class SizeBench:
    """All measurements for one value size."""

    def __init__(self, size: int, count: int, repeat: int, seed: int, workdir: Path) -> None:
        self.size = size
        self.count = count
        self.repeat = repeat
        self.workdir = workdir
        self.namespace = Namespace("bench", "bench-model", _layout_for(size))
        self.keys = block_keys(self.namespace, list(range(count * 16)))
        rng = np.random.default_rng(seed)
        self.source = rng.integers(0, 256, size * count, dtype=np.uint8)
        self.values = [self.source[i * size : (i + 1) * size] for i in range(count)]
        self.bufs = [np.empty(size, np.uint8) for _ in range(count)]
        for buf in self.bufs:
            buf.fill(0)  # fault the pages in now
        self.total = size * count

    def _store(self, engine: str, dram: int, ssd: int) -> tuple[Shard, EmbeddedClient]:
        cfg = StoreConfig(
            data_dir=Path(tempfile.mkdtemp(dir=self.workdir)),
            engine=engine,
            dram_capacity_bytes=dram,
            ssd_capacity_bytes=ssd,
            high_watermark=1.0,
            low_watermark=0.9,
            value_size=self.size,
            dram_prefault=True,
            flush_on_close=False,
        )
        shard = Shard(cfg, self.namespace.fingerprint())
        return shard, EmbeddedClient(shard, self.namespace)

    def tier(self, engine: str, dram: bool) -> dict[str, Any]:
        """put / batch_put passes, then read rounds that interleave every read kind with its
        baseline (memcpy for DRAM, the raw engine get for SSD), so that noise from other work
        on the machine hits both alike; ratios are medians of per-round ratios."""
        room = self.total + (16 << 20)
        if dram:
            shard, client = self._store("memory", room, 0)
        else:
            shard, client = self._store(engine, 0, 2 * room)
        keys, values, bufs = self.keys, self.values, self.bufs
        out: dict[str, Any] = {}
        try:
            for name in ("put", "batch_put"):
                passes = []
                for _ in range(self.repeat):
                    for key in keys:
                        client.remove(key)
                    if name == "put":
                        passes.append(
                            _timed(
                                lambda: [
                                    client.put(k, v) for k, v in zip(keys, values, strict=True)
                                ]
                            )
                        )
                    else:
                        passes.append(_timed(lambda: client.batch_put(keys, values)))
                out[name] = _rate(self.total, passes)
            if not dram:  # read from the engine's files, not its write buffer
                shard._state.ssd.engine.flush()  # type: ignore[union-attr]
            reads = self._read_fns(client, shard, dram)
            for fn in reads.values():
                fn()  # warm: page cache, destination pages
            rounds: dict[str, list[float]] = {name: [] for name in reads}
            for _ in range(self.repeat):
                for name, fn in reads.items():
                    rounds[name].append(_timed(fn))
            for name, passes in rounds.items():
                out[name] = _rate(self.total, passes)
            base = "memcpy" if dram else "raw_engine_get"
            out["ratios"] = {
                name: statistics.median(b / t for b, t in zip(rounds[base], passes, strict=True))
                for name, passes in rounds.items()
                if name != base
            }
            for i in (0, len(keys) - 1):
                if not np.array_equal(bufs[i], values[i]):
                    raise RuntimeError("benchmark read back wrong bytes")
        finally:
            shard.close()
        return out

    def _read_fns(
        self, client: EmbeddedClient, shard: Shard, dram: bool
    ) -> dict[str, Callable[[], None]]:
        keys, bufs, values = self.keys, self.bufs, self.values
        one = bufs[0]

        def get_into() -> None:
            for key, buf in zip(keys, bufs, strict=True):
                if client.get_into(key, buf) is None:
                    raise RuntimeError("benchmark miss")

        def get_into_one_buffer() -> None:
            for key in keys:
                if client.get_into(key, one) is None:
                    raise RuntimeError("benchmark miss")

        def batch_get_into() -> None:
            if None in client.batch_get_into(keys, bufs):
                raise RuntimeError("benchmark miss")

        fns: dict[str, Callable[[], None]] = {}
        if dram:

            def memcpy() -> None:
                for value, buf in zip(values, bufs, strict=True):
                    buf[:] = value

            fns["memcpy"] = memcpy
        else:
            engine = shard._state.ssd.engine  # type: ignore[union-attr]

            def raw_engine_get() -> None:
                for key in keys:
                    if engine.get(key) is None:
                        raise RuntimeError("benchmark raw miss")

            fns["raw_engine_get"] = raw_engine_get
        fns.update(
            get_into=get_into,
            get_into_one_buffer=get_into_one_buffer,
            batch_get_into=batch_get_into,
        )
        return fns


def kv_pages(
    model_dir: str | None, seed: int, dtype: str = "bfloat16"
) -> tuple[list[np.ndarray], str, int]:
    """(pages as uint8 arrays, where they came from, element width)."""
    if model_dir:
        from kvflow.stages.engine import Engine, EngineConfig, SamplingParams

        engine = Engine.open(model_dir, EngineConfig(dtype=dtype, num_pages=64))
        rng = np.random.default_rng(seed)
        prompt = rng.integers(3, 300, 16 * engine.block_size).tolist()
        engine.add_request("bench-pages", prompt, SamplingParams(max_tokens=1), retain_pages=True)
        while engine.has_unfinished():
            engine.step()
        pages = [
            engine.export_page("bench-pages", i)
            .contiguous()
            .view(-1)
            .view(__import__("torch").uint8)
            .numpy()
            .copy()
            for i in range(16)
        ]
        engine.release("bench-pages")
        width = engine.page_dtype.itemsize
        return pages, f"engine pages from {model_dir} ({engine.page_dtype})", width
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = (8, 2, 2, 64, 128)  # layers, k/v, kv heads, block, head dim
    pages = [
        torch.randn(shape, generator=gen)
        .to(torch.bfloat16)
        .view(torch.uint8)
        .numpy()
        .copy()
        .reshape(-1)
        for _ in range(16)
    ]
    return pages, "seeded random bf16 tensors shaped like KV (8x2x2x64x128)", 2


def compression(model_dir: str | None, seed: int, dtype: str = "bfloat16") -> dict[str, Any]:
    pages, source, width = kv_pages(model_dir, seed, dtype)
    raw = sum(p.nbytes for p in pages)
    out: dict[str, Any] = {"source": source, "pages": len(pages), "raw_bytes": raw}
    for label, shuffle in (("zstd3", 1), (f"zstd3_shuffle{width}", width)):
        start = time.perf_counter()
        stored = sum(
            len(
                codec.encode_record(
                    p, 0, None, tenant="default", compress=True, level=3, shuffle_width=shuffle
                )
            )
            for p in pages
        )
        elapsed = time.perf_counter() - start
        out[label] = {"ratio": raw / stored, "compress_gbps": raw / elapsed / 1e9}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64KiB,1MiB,4MiB", help="of " + ",".join(SIZES))
    parser.add_argument(
        "--working-set-mib", type=int, default=128, help="bytes of values per size and tier"
    )
    parser.add_argument("--engines", default="rocksdb,lmdb")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pages", default=None, help="model dir: measure zstd on its KV pages")
    parser.add_argument("--pages-dtype", default="bfloat16", help="engine dtype for --pages")
    parser.add_argument("--workdir", default=None, help="where SSD tiers go (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the full results here")
    parser.add_argument(
        "--remote", action="store_true", help="two processes: remote batch get_into vs raw socket"
    )
    args = parser.parse_args(argv)
    if args.remote:
        return _remote(args)
    engines = [e for e in args.engines.split(",") if e]
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "args": vars(args),
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for label in args.sizes.split(","):
            size = SIZES[label]
            count = max(8, (args.working_set_mib << 20) // size)
            bench = SizeBench(size, count, args.repeat, args.seed, Path(tmp))
            entry: dict[str, Any] = {"bytes": size, "count": count}
            entry["dram"] = bench.tier("memory", dram=True)
            entry["ssd"] = {e: bench.tier(e, dram=False) for e in engines}
            results["sizes"][label] = entry
            del bench
    results["compression"] = compression(args.pages, args.seed, args.pages_dtype)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(summary(results))
    return 0


def _remote(args: argparse.Namespace) -> int:
    from kvflow.tools.bench import kvdb_remote as bench_kvdb_remote

    sizes = [SIZES[label] for label in args.sizes.split(",")]
    report = bench_kvdb_remote.run_remote(sizes, args.working_set_mib, args.repeat, args.seed)
    report["machine"] = {"python": platform.python_version(), "platform": platform.platform()}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(bench_kvdb_remote.summary(report))
    return 0


def summary(results: dict[str, Any]) -> str:
    sizes = results["sizes"]
    label = "1MiB" if "1MiB" in sizes else next(iter(sizes))
    e = sizes[label]
    dram = e["dram"]
    parts = [
        f"kvdb {label}: DRAM batch_get_into {dram['batch_get_into']['gbps']:.2f} GB/s = "
        f"{dram['ratios']['batch_get_into']:.0%} of memcpy {dram['memcpy']['gbps']:.2f} GB/s"
    ]
    for name, ssd in e["ssd"].items():
        parts.append(
            f"SSD {name} get_into {ssd['get_into']['gbps']:.2f} GB/s = "
            f"{ssd['ratios']['get_into']:.0%} of raw get {ssd['raw_engine_get']['gbps']:.2f} "
            f"({ssd['ratios']['get_into_one_buffer']:.0%} into one reused buffer)"
        )
    comp = results["compression"]
    ratios = [v["ratio"] for k, v in comp.items() if isinstance(v, dict)]
    parts.append(f"zstd ratio {ratios[0]:.2f}x / shuffled {ratios[-1]:.2f}x")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
