"""How much memory and disk a server reserves, decided once from the model and the machine.

``kvflow serve`` (embedded, node) gives ``--num-pages``, ``--dram-mb`` and ``--ssd-mb`` no
fixed default: ``plan_memory`` sizes each one left unset.

- KV pages per engine (and the same number of slots in each staging area): enough for one
  sequence of ``min(max_model_len, 4096)`` tokens, more when the KV budget allows — the
  budget is 1/16 of the memory available now, at most 768 MiB per pool — and at most 512.
  (A pool is zero pages the kernel maps lazily. ``kvflow serve`` writes one such pool's
  pages in the engine that prefills at start-up, as vLLM allocates its KV cache
  (``--kv-prefault``, the default; a colocated engine holds two pools' pages and writes the
  first pool's): the prompts' K/V writes take no first-use page faults. Otherwise, and for a
  decode engine and the staging areas, only the pages of one such sequence are written at
  start-up (`engine.pages.resident_pages`) and the rest become resident as they are used.)
- DRAM tiers: a quarter of the available memory for the process's shards together, split
  evenly, each between 64 MiB and 16 GiB. The DRAM tier is the cache a prefix hit reads
  from, and a lazily mapped pool (resident as blocks are cached); when it is full a store
  evicts blocks to the SSD tier, writing them on the storing thread unless they were
  written behind while the engine was idle (``--dram-write-behind``). At 256 MiB a
  shard, the earlier cap, SmolLM2-135M's 2,000-token prompts filled it after three, and the
  demotions cost the 32 x 2 burst 8-12% of its time on 2 cores (docs/performance.md).
- SSD tier per shard: a quarter of the free disk under the data directory, at most 8 GiB.
- Weights per engine: the parameters in the engine's dtype and, for float32, the second
  copy of the decoder linears' weights (with panels, the lm_head's too) where it fits
  (`onednn_linear.prepack_planned`, the engine's own decision; ``KVFLOW_LINEAR=gemv`` drops
  it).

A value the user gives is kept as given. ``MemoryPlan.describe`` is the line the server
prints at start: what it reserved and which flags change it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from kvflow.stages.engine.meminfo import available_at_start

MIB = 1 << 20
MAX_AUTO_PAGES = 512
MAX_POOL_BYTES = 768 * MIB  # the KV budget of one pool, at most
MIN_DRAM_BYTES = 64 * MIB
MAX_DRAM_BYTES = 16 << 30
DRAM_SHARE = 4  # the shards' DRAM tiers together: 1/DRAM_SHARE of the available memory
MAX_SSD_BYTES = 8 << 30
MIN_SSD_BYTES = 256 * MIB
MIN_SEQUENCE_TOKENS = 4096  # one sequence this long always fits (or max_model_len if shorter)
ITEM_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 2, "int4": 2}
"""Bytes of one KV element per engine dtype (int8/int4 engines keep bf16 KV)."""
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}
"""About how many bytes one parameter takes (int8/int4: the quantized linears' share; the
embeddings stay bf16, so the estimate is low for small models)."""


def free_disk_bytes(path: Path) -> int | None:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    for p in (path, *path.resolve().parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


@dataclass(frozen=True)
class MemoryPlan:
    """What one process reserves. ``engines`` engines each hold ``num_pages`` KV pages of
    ``page_nbytes`` and a staging area of ``staging_pages``; ``shards`` kvdb shards each hold
    a DRAM tier of ``dram_bytes`` and an SSD tier of ``ssd_bytes``; ``auto`` names the values
    sized here (the others were given). ``weight_copies``: the engines that load weights of
    their own (a colocated server's prefill and decode instance share one engine and one copy
    of the weights; None: ``engines``)."""

    page_nbytes: int
    num_pages: int
    staging_pages: int
    dram_bytes: int
    ssd_bytes: int
    engines: int
    shards: int
    weights_bytes: int
    auto: tuple[str, ...]
    prepack_bytes: int = 0
    weight_copies: int | None = None
    device: str = "cpu"
    kv_prefault: bool = True

    @property
    def copies(self) -> int:
        """How many copies of the weights (and of their prefill copy) the process loads."""
        return self.engines if self.weight_copies is None else self.weight_copies

    @property
    def kv_bytes(self) -> int:
        """KV pages and staging slots of every engine, allocated at start."""
        return self.engines * (self.num_pages + self.staging_pages) * self.page_nbytes

    def describe(self) -> str:
        """One line: what is reserved, and the flags that change it."""

        def mib(n: int) -> str:
            return f"{n / MIB:,.0f} MiB"

        def tag(name: str) -> str:
            return " (auto)" if name in self.auto else ""

        prepacked = ""
        if self.prepack_bytes:
            prepacked = (
                f" + {mib(self.copies * self.prepack_bytes)} copied for the CPU products "
                "(KVFLOW_LINEAR=gemv drops it)"
            )
        where = "" if self.device == "cpu" else f" on {self.device}"
        written = (
            f" ({self.num_pages} KV pages of the prefilling engine written at start; "
            "--no-kv-prefault: as used)"
            if self.kv_prefault
            else " (the KV pages mapped as used)"
        )
        return (
            f"memory{where}: {self.engines} instance(s) x ({self.num_pages} KV pages"
            f"{tag('num_pages')} "
            f"+ {self.staging_pages} staging) x {self.page_nbytes / MIB:.2f} MiB = "
            f"{mib(self.kv_bytes)} reserved{written}, weights about "
            f"{mib(self.copies * self.weights_bytes)}{prepacked}; DRAM tier "
            f"{mib(self.dram_bytes)}"
            f"{tag('dram_mb')} x {self.shards} shard(s), filled as blocks are cached; SSD tier "
            f"{mib(self.ssd_bytes)}{tag('ssd_mb')} x {self.shards} shard(s). Change with "
            "--num-pages, --dram-mb, --ssd-mb"
        )


def page_nbytes(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str
) -> int:
    """Bytes of one KV page: ``[layers, 2, kv_heads, block_size, head_dim]`` of ``dtype``."""
    return num_layers * 2 * num_kv_heads * block_size * head_dim * ITEM_SIZE[dtype]


def default_dram_bytes(shards: int, available: int | None) -> int:
    """Each of ``shards`` DRAM tiers' default: together a quarter of ``available`` (None:
    unknown, the cap), each between MIN_DRAM_BYTES and MAX_DRAM_BYTES, in whole MiB. The
    shards of one process, or every node of a local cluster (`tools/supervise.py`)."""
    share = MAX_DRAM_BYTES if available is None else available // DRAM_SHARE // max(1, shards)
    return max(MIN_DRAM_BYTES, min(MAX_DRAM_BYTES, share)) // MIB * MIB


def plan_memory(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    max_model_len: int,
    num_params: int,
    dtype: str,
    block_size: int,
    engines: int,
    shards: int,
    num_pages: int | None = None,
    dram_bytes: int | None = None,
    ssd_bytes: int | None = None,
    available: int | None = None,
    free_disk: int | None = None,
    linear_params: int = 0,
    weight_copies: int | None = None,
    device: str = "cpu",
    kv_prefault: bool = True,
) -> MemoryPlan:
    """The plan for a process of ``engines`` engines and ``shards`` shards of this model.
    ``available`` / ``free_disk``: the machine's (None: unknown; the caps are used);
    ``linear_params``: the weights a float32 engine copies where `prepack_planned` says (on
    the CPU only): the decoder linears' and, with panels, the lm_head's
    (`onednn_linear.copied_params`).
    ``device``: the engines' ("cpu" or "cuda[:N]"); on a GPU the pages and weights are
    in its memory, sized the same way (the host holds a mirror of each pool, mapped as it
    is written)."""
    from kvflow.stages.engine.onednn_linear import prepack_planned

    page = page_nbytes(num_layers, num_kv_heads, head_dim, block_size, dtype)
    prepack = 4 * linear_params
    if device != "cpu" or not prepack_planned(dtype, prepack, available):
        prepack = 0
    auto: list[str] = []
    if num_pages is None:
        auto.append("num_pages")
        one_sequence = -(-min(max_model_len, MIN_SEQUENCE_TOKENS) // block_size)
        budget = MAX_POOL_BYTES if available is None else min(MAX_POOL_BYTES, available // 16)
        num_pages = max(one_sequence, min(MAX_AUTO_PAGES, budget // page))
    if dram_bytes is None:
        auto.append("dram_mb")
        dram_bytes = default_dram_bytes(shards, available)
    if ssd_bytes is None:
        auto.append("ssd_mb")
        share = MAX_SSD_BYTES if free_disk is None else free_disk // 4
        ssd_bytes = max(MIN_SSD_BYTES, min(MAX_SSD_BYTES, share)) // MIB * MIB
    return MemoryPlan(
        page_nbytes=page,
        num_pages=num_pages,
        staging_pages=num_pages,
        dram_bytes=dram_bytes,
        ssd_bytes=ssd_bytes,
        engines=engines,
        shards=shards,
        weights_bytes=int(num_params * WEIGHT_BYTES[dtype]),
        auto=tuple(auto),
        prepack_bytes=prepack,
        weight_copies=weight_copies,
        device=device,
        kv_prefault=kv_prefault,
    )


def plan_for_model(
    model_dir: Path,
    *,
    dtype: str,
    block_size: int,
    engines: int,
    shards: int,
    data_dir: Path,
    device: str = "cpu",
    num_pages: int | None = None,
    dram_bytes: int | None = None,
    ssd_bytes: int | None = None,
    kv_prefault: bool = True,
) -> MemoryPlan:
    """``plan_memory`` for the model in ``model_dir`` (its config.json only; no weights are
    read) on this machine."""
    from kvflow.stages.engine.onednn_linear import copied_params
    from kvflow.stages.engine.spec import load_spec

    spec, _ = load_spec(model_dir)
    return plan_memory(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_model_len=spec.max_position_embeddings,
        num_params=spec.num_params,
        linear_params=copied_params(spec.linear_params, spec.vocab_size * spec.hidden_size),
        dtype=dtype,
        device=device,
        block_size=block_size,
        engines=engines,
        shards=shards,
        num_pages=num_pages,
        dram_bytes=dram_bytes,
        ssd_bytes=ssd_bytes,
        available=available_at_start(),
        free_disk=free_disk_bytes(data_dir),
        kv_prefault=kv_prefault,
    )
