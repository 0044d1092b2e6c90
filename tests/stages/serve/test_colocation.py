"""Whether the embedded server colocates (stages/serve/colocation.py, the one place that
decides), and the prefill budget a colocated engine gets beside running streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.stages.serve.colocation import (
    COLOCATED_MIXED_CHUNK,
    SMALL_MACHINE_CORES,
    embedded_colocate,
    mixed_chunk,
    tbt_target_ms,
)
from kvflow.stages.serve.memory import plan_memory
from kvflow.tools.cli import build_parser
from kvflow.tools.serve import config_from_args, weight_copies


def test_a_small_machine_colocates_by_default_a_larger_one_does_not() -> None:
    assert embedded_colocate(None, 1, 1, 1)
    assert embedded_colocate(None, 1, 1, SMALL_MACHINE_CORES)
    assert not embedded_colocate(None, 1, 1, SMALL_MACHINE_CORES + 1)
    assert not embedded_colocate(None, 2, 1, 2)  # colocation pairs instances
    # on a GPU two engines in one process contend for the interpreter lock: colocated
    assert embedded_colocate(None, 1, 1, 16, "cuda")
    assert embedded_colocate(None, 2, 2, 16, "cuda:1")
    assert not embedded_colocate(None, 2, 1, 16, "cuda")


@pytest.mark.parametrize("ncores", [1, 2, 16])
def test_the_flag_decides_outright(ncores: int) -> None:
    assert embedded_colocate(True, 1, 1, ncores)
    assert not embedded_colocate(False, 1, 1, ncores)


def test_mixed_chunk_default_only_for_a_colocated_engine() -> None:
    assert mixed_chunk(True, None) == COLOCATED_MIXED_CHUNK
    assert mixed_chunk(False, None) is None
    assert mixed_chunk(True, 64) == 64 and mixed_chunk(False, 64) == 64


def test_tbt_target_only_when_given_and_zero_turns_it_off() -> None:
    # off by default: a 200 ms target cost the side-by-side's concurrency rows 17-36%
    assert tbt_target_ms(None) is None
    assert tbt_target_ms(0.0) is None
    assert tbt_target_ms(80.0) == 80.0


@pytest.mark.parametrize(
    ("flags", "expected"), [(["--colocate"], True), (["--no-colocate"], False)]
)
def test_serve_flags_reach_the_config(flags: list[str], expected: bool, tmp_path: Path) -> None:
    args = build_parser("serve").parse_args(
        ["serve", "--model", str(tmp_path), "--data-dir", str(tmp_path), "--mixed-chunk", "96",
         "--tbt-target-ms", "120", *flags]
    )  # fmt: skip
    plan = plan_memory(
        num_layers=2, num_kv_heads=1, head_dim=8, max_model_len=256, num_params=1000,
        dtype="float32", block_size=16, engines=2, shards=2, available=1 << 30, free_disk=1 << 30,
    )  # fmt: skip
    config = config_from_args(args, plan)
    assert config.colocate is expected and config.mixed_chunk == 96
    assert config.tbt_target_ms == 120.0 and config.device == "cpu"
    args.device = "cuda:1"  # checked against the machine at start (serve.run), not here
    assert config_from_args(args, plan).device == "cuda:1"
    with pytest.raises(ValueError, match="tbt_target_ms"):
        config_from_args(build_parser("serve").parse_args(
            ["serve", "--model", str(tmp_path), "--data-dir", str(tmp_path),
             "--tbt-target-ms", "-1", *flags]
        ), plan)  # fmt: skip


def test_a_colocated_pair_loads_one_copy_of_the_weights() -> None:
    """The memory plan counts the engines that load weights: one per colocated pair, one per
    instance otherwise."""
    assert weight_copies(1, 1, colocate=True) == 1
    assert weight_copies(2, 2, colocate=True) == 2
    assert weight_copies(1, 1, colocate=False) == 2
    assert weight_copies(2, 1, colocate=False) == 3
