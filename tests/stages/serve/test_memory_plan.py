"""The memory plan (stages/serve/memory.py): sizes from the model and the machine when not
given, the given ones kept, and the line the server prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow.stages.engine.onednn_linear import ENV_LINEAR, PREPACK_SHARE
from kvflow.stages.serve.memory import MIB, page_nbytes, plan_for_model, plan_memory

# SmolLM2-135M-Instruct's shapes (the default model)
SMOL = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "max_model_len": 8192}
GIB = 1 << 30


LINEAR_PARAMS = 106_168_320  # the decoder linears' weights: 405 MiB in float32


def smol(**kw: object) -> object:
    base = {**SMOL, "num_params": 134_515_008, "dtype": "float32", "block_size": 64}
    base["linear_params"] = LINEAR_PARAMS
    return plan_memory(**{**base, "engines": 2, "shards": 2, **kw})  # type: ignore[arg-type]


def test_page_size_of_the_default_model() -> None:
    assert page_nbytes(30, 3, 64, 64, "float32") == 2_949_120  # 2.81 MiB
    assert page_nbytes(30, 3, 64, 64, "bfloat16") == 2_949_120 // 2
    for quantized in ("int8", "int4"):  # weight-only: bf16 KV pages
        assert page_nbytes(30, 3, 64, 64, quantized) == 2_949_120 // 2


def test_quantized_weights_are_planned_smaller() -> None:
    f32, b16, i8, i4 = (
        smol(dtype=d, available=8 * GIB) for d in ("float32", "bfloat16", "int8", "int4")
    )
    assert f32.weights_bytes == 2 * b16.weights_bytes == 4 * i8.weights_bytes  # type: ignore[attr-defined]
    assert i8.weights_bytes == 2 * i4.weights_bytes  # type: ignore[attr-defined]


def test_a_laptop_gets_a_sixteenth_of_its_memory_per_pool() -> None:
    plan = smol(available=8 * GIB, free_disk=100 * GIB)
    assert plan.num_pages == plan.staging_pages == 182  # 512 MiB: 11,648 tokens per engine
    assert plan.dram_bytes == GIB and plan.ssd_bytes == 8 * GIB  # 2 shards: 2 GiB of 8
    assert plan.kv_bytes == 2 * 2 * 182 * 2_949_120  # 2 GiB for both engines, taken as used


def test_a_large_machine_stops_at_768_mib_a_pool() -> None:
    plan = smol(available=64 * GIB)
    assert plan.num_pages == 768 * MIB // 2_949_120 == 273  # 17,472 tokens per engine
    assert plan.dram_bytes == 8 * GIB  # a quarter of 64 GiB over 2 shards
    capped = smol(available=512 * GIB)
    assert capped.dram_bytes == 16 * GIB  # type: ignore[attr-defined]
    assert plan.auto == ("num_pages", "dram_mb", "ssd_mb")


def test_a_small_machine_and_disk_shrink_the_tiers() -> None:
    plan = smol(available=1 * GIB, free_disk=2 * GIB)
    assert plan.num_pages == 64  # never fewer than one sequence
    assert plan.dram_bytes == 128 * MIB  # a quarter of 1 GiB over 2 shards
    floor = smol(available=256 * MIB)
    assert floor.dram_bytes == 64 * MIB  # type: ignore[attr-defined]
    assert plan.ssd_bytes == 512 * MIB  # a quarter of the free disk


def test_a_small_model_gets_more_pages_up_to_512() -> None:
    tiny = plan_memory(num_layers=2, num_kv_heads=2, head_dim=16, max_model_len=2048,
                       num_params=100_000, dtype="float32", block_size=16, engines=2,
                       shards=2, available=16 * GIB)  # fmt: skip
    assert tiny.num_pages == 512


def test_given_values_are_kept() -> None:
    plan = smol(num_pages=512, dram_bytes=1024 * MIB, ssd_bytes=8192 * MIB, available=GIB)
    assert (plan.num_pages, plan.dram_bytes, plan.ssd_bytes) == (512, 1024 * MIB, 8192 * MIB)
    assert plan.auto == ()
    line = plan.describe()
    assert "512 KV pages +" in line and "(auto)" not in line
    assert line.endswith("Change with --num-pages, --dram-mb, --ssd-mb")


def test_plan_for_a_model_directory(tiny_model: Path, tmp_path: Path) -> None:
    plan = plan_for_model(tiny_model, dtype="float32", block_size=16, engines=1, shards=1,
                          data_dir=tmp_path / "not-yet")  # fmt: skip
    assert plan.num_pages >= 1 and plan.dram_bytes >= 64 * MIB
    assert "1 instance(s)" in plan.describe() and "(auto)" in plan.describe()


@pytest.mark.parametrize("form", ["panel", "transposed"])
def test_a_model_directory_plans_the_copy_the_engine_makes(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """The plan for a model counts the decoder linears' copy and, in panels, the lm_head's
    (the vocabulary again): the same linears the engine copies (`prepack_candidates`)."""
    import torch

    from kvflow.stages.engine.cpu_panel import panel_kernel
    from kvflow.stages.engine.loader import load_weights
    from kvflow.stages.engine.onednn_linear import OneDNNDenseLinear
    from kvflow.stages.engine.spec import load_spec

    if form == "panel" and panel_kernel() is None:
        pytest.skip("the panel kernel is not built here")
    monkeypatch.setenv(ENV_LINEAR, form)
    spec, _ = load_spec(tiny_model)
    plan = plan_for_model(tiny_model, dtype="float32", block_size=16, engines=1, shards=1,
                          data_dir=tmp_path / "not-yet")  # fmt: skip
    head = spec.vocab_size * spec.hidden_size if form == "panel" else 0
    assert plan.prepack_bytes == 4 * (spec.linear_params + head)
    model = load_weights(tiny_model, spec, torch.float32, torch.device("cpu"))
    copied = [m for m in model.modules() if isinstance(m, OneDNNDenseLinear) and m.has_copy]
    assert sum(4 * m.weight.numel() for m in copied) == plan.prepack_bytes


def test_float32_plans_the_prefill_copy_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan counts the float32 prefill copy the engines make (onednn_linear's
    `prepack_planned`), says so, and names the way out; not where it does not fit, not for
    other dtypes, not with KVFLOW_LINEAR=gemv."""
    monkeypatch.delenv(ENV_LINEAR, raising=False)
    copy = 4 * LINEAR_PARAMS
    plan = smol(available=24 * GIB)
    assert plan.prepack_bytes == copy  # type: ignore[attr-defined]
    assert "+ 810 MiB copied for the CPU products (KVFLOW_LINEAR=gemv drops it)" in plan.describe()  # type: ignore[attr-defined]
    assert smol(available=PREPACK_SHARE * copy).prepack_bytes == copy  # type: ignore[attr-defined]
    small = smol(available=PREPACK_SHARE * copy - 1)
    assert small.prepack_bytes == 0 and "copied" not in small.describe()  # type: ignore[attr-defined]
    assert smol(dtype="bfloat16", available=24 * GIB).prepack_bytes == 0  # type: ignore[attr-defined]
    on_gpu = smol(available=24 * GIB, device="cuda")  # the weights are the GPU's: no copy
    assert on_gpu.prepack_bytes == 0 and on_gpu.describe().startswith("memory on cuda: ")  # type: ignore[attr-defined]
    monkeypatch.setenv(ENV_LINEAR, "gemv")
    assert smol(available=24 * GIB).prepack_bytes == 0  # type: ignore[attr-defined]


def test_a_colocated_server_counts_one_copy_of_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two instances sharing one engine (colocated) load the weights and their prefill copy
    once: the printed line counts one copy, the KV pages of both instances."""
    monkeypatch.delenv(ENV_LINEAR, raising=False)
    both = smol(available=24 * GIB)
    shared = smol(available=24 * GIB, weight_copies=1)
    assert both.copies == 2 and shared.copies == 1  # type: ignore[attr-defined]
    assert shared.kv_bytes == both.kv_bytes  # type: ignore[attr-defined]
    weights = both.weights_bytes / MIB  # type: ignore[attr-defined]
    prepack = both.prepack_bytes / MIB  # type: ignore[attr-defined]
    assert prepack > 0
    assert f"weights about {weights:,.0f} MiB + {prepack:,.0f} MiB copied" in shared.describe()  # type: ignore[attr-defined]
    assert f"weights about {2 * weights:,.0f} MiB" in both.describe()  # type: ignore[attr-defined]


def test_the_nodes_share_the_hosts_dram_quarter(tmp_path: Path) -> None:
    """A local cluster's nodes share one host: each node's DRAM tier is its share of the
    quarter of the memory that one process's shards would take, unless --dram-mb is given."""
    from kvflow.stages.engine.meminfo import available_at_start
    from kvflow.stages.serve.memory import default_dram_bytes
    from kvflow.tools.supervise import LocalCluster

    def dram_mb(cluster: Any) -> dict[str, str]:
        return {
            name: p.args[p.args.index("--dram-mb") + 1]
            for name, p in cluster.procs.items()
            if "--dram-mb" in p.args
        }

    cluster = LocalCluster(tmp_path / "a", meta=1, prefill=2, decode=1)  # never started
    each = str(default_dram_bytes(3, available_at_start()) // MIB)
    assert dram_mb(cluster) == {"prefill-0": each, "prefill-1": each, "decode-0": each}
    given = LocalCluster(tmp_path / "b", meta=1, prefill=1, decode=1, extra=("--dram-mb=128",))
    assert dram_mb(given) == {}
    assert all("--dram-mb=128" in given.procs[n].args for n in ("prefill-0", "decode-0"))
