"""int8 / int4 weight-only engines (precision.py, quant_linear.py): each quantized linear is
within half a quantization step of its float weight and the kernel computes with exactly that
weight; an engine agrees with a float32 engine holding the same dequantized weights up to bf16
activation rounding; cached (imported) KV gives the recomputed tokens; a bad dtype is named.
The accuracy cost on the default model is in docs/performance.md."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from kvflow.stages.engine import EngineConfig, ModelLoadError, SamplingParams
from kvflow.stages.engine.loader import load_weights
from kvflow.stages.engine.onednn_linear import OneDNNDenseLinear
from kvflow.stages.engine.precision import PRECISIONS, precision
from kvflow.stages.engine.quant_linear import (
    DEQUANT_ROWS,
    INT4_BLOCKS_N,
    Int4Linear,
    Int8Linear,
    missing_kernel,
)
from kvflow.stages.engine.spec import load_spec
from kvflow.stages.serve.config import DTYPES
from kvflow.tools.args import add_engine_store_flags
from kvflow.tools.bench.precision import compare, equivalence_prompt
from kvflow.tools.bench.roofline import open_engine as open_bench_engine
from tests.stages.engine.conftest import open_engine

QUANT = (Int8Linear, Int4Linear)


def _linear(n: int, k: int, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        linear.weight[0].zero_()  # an all-zero row quantizes exactly, and so does (int4) a
        linear.weight[1, :32] = 0.01  # constant group
        linear.bias.copy_(torch.randn(n, generator=gen))
    return linear


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linear_within_half_a_step(bits: int) -> None:
    linear = _linear(96, 128, seed=bits)
    w = linear.weight.detach()
    if bits == 8:
        q = Int8Linear(linear, torch.float32)
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        q = Int4Linear(linear, torch.float32, 32)
        g = w.reshape(96, 4, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, dim=1)
    deq = q.dequantized()
    assert deq.shape == w.shape
    assert torch.all((deq - w).abs() <= step / 2 + 1e-6), float((deq - w).abs().max())
    assert torch.equal(deq[0], torch.zeros(128))
    if bits == 4:
        assert torch.allclose(deq[1, :32], torch.full((32,), 0.01), atol=1e-6)
    assert float((deq - w).abs().max()) > 0  # it really is quantized
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ deq.T + linear.bias.detach()
    assert torch.allclose(q(x), expected, atol=1e-4), float((q(x) - expected).abs().max())


def test_int8_prefill_rows_dequantize_and_agree_with_the_kernel() -> None:
    """A prefill chunk (>= DEQUANT_ROWS rows) multiplies the dequantized weight, a decode
    batch runs the int8 kernel: both give x @ W_deq.T, row for row, in float32 and in bf16."""
    linear = _linear(96, 128, seed=3)
    x = torch.randn(DEQUANT_ROWS + 8, 128, generator=torch.Generator().manual_seed(2))
    for compute, atol in ((torch.float32, 1e-4), (torch.bfloat16, 6e-2)):
        q = Int8Linear(linear, compute)
        xc = x.to(compute)
        expected = xc.float() @ q.dequantized().T + linear.bias.detach()
        whole = q(xc)  # the dequantizing path
        rows = torch.cat([q(xc[i : i + 4]) for i in range(0, len(xc), 4)])  # the kernel
        assert whole.dtype == rows.dtype == compute
        for got in (whole, rows):
            assert torch.allclose(got.float(), expected, atol=atol), float(
                (got.float() - expected).abs().max()
            )


def test_int4_prefill_rows_unpack_and_agree_with_the_kernel() -> None:
    """A prefill chunk (>= DEQUANT_ROWS rows) unpacks the nibbles into the compute dtype and
    multiplies with F.linear, a decode batch runs the int4 kernel: both give x @ W_deq.T,
    row for row, in float32 and in bf16. torch packs 64 rows a block where ATen runs its
    AVX-512 kernels and 32 with AVX2: 128 rows unpack with either, 96 rows only in blocks of
    32; a weight that is not whole blocks keeps the kernel for every call, and still agrees."""
    x = torch.randn(DEQUANT_ROWS + 8, 128, generator=torch.Generator().manual_seed(2))
    for rows_out in (128, 96):
        linear = _linear(rows_out, 128, seed=5)
        for compute, atol, w_atol in ((torch.float32, 1e-4, 1e-6), (torch.bfloat16, 6e-2, 1e-3)):
            q = Int4Linear(linear, compute, 32)
            if rows_out == 128:
                assert q.block_n in INT4_BLOCKS_N  # whole blocks of either packing
            else:
                assert q.block_n in (0, 32)  # 96 rows: whole blocks of 32 only
            unpacks = q.block_n > 0
            assert (q.deq_scale is not None) is unpacks
            xc = x.to(compute)
            expected = xc.float() @ q.dequantized().T + linear.bias.detach()
            whole = q(xc)  # the unpacking path (where it applies)
            rows = torch.cat([q(xc[i : i + 4]) for i in range(0, len(xc), 4)])  # the kernel
            assert whole.dtype == rows.dtype == compute
            for got in (whole, rows):
                assert torch.allclose(got.float(), expected, atol=atol), float(
                    (got.float() - expected).abs().max()
                )
            if unpacks:  # the unpacked weight is the kernel's, element for element
                w = q.weight_t().t().float()
                assert torch.allclose(w, q.dequantized(), atol=w_atol), float(
                    (w - q.dequantized()).abs().max()
                )


def _dequantized_twin(cand_dir: Path, cand: nn.Module) -> nn.Module:
    """A float32 engine's model whose decoder linears hold `cand`'s dequantized weights (in the
    quantized engines' layout: separate projections)."""
    config = EngineConfig(block_size=8, num_pages=64, prefill_chunk=16, return_logits=True)
    ref = open_bench_engine(cand_dir, config, fuse=False)
    for (name, module), (_, twin) in zip(
        cand.model.layers.named_modules(), ref.model.model.layers.named_modules(), strict=True
    ):
        if isinstance(module, QUANT):
            assert isinstance(twin, (nn.Linear, OneDNNDenseLinear)), name  # weight: a parameter
            with torch.no_grad():
                twin.weight.copy_(module.dequantized())
            if isinstance(twin, OneDNNDenseLinear):
                twin.refresh()  # its copy (prefill rows; with panels, every row) follows
    return ref


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_engine_equals_float32_with_the_same_weights(llama_dir: Path, dtype: str) -> None:
    cand = open_engine(llama_dir, prefill_chunk=16, dtype=dtype)
    linears = [m for m in cand.model.model.layers.modules() if isinstance(m, QUANT)]
    assert len(linears) == 7 * cand.spec.num_layers
    assert not any(isinstance(m, nn.Linear) for m in cand.model.model.layers.modules())
    assert cand.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert cand.page_dtype == torch.bfloat16 and cand.kv_layout.dtype == "bfloat16"
    ref = _dequantized_twin(llama_dir, cand.model)
    result = compare(ref, cand, [equivalence_prompt()], 16)
    # Only the bf16 activations differ (the weights are the same numbers): the bf16 engine's
    # own band against float32 (test_bf16.py: 0.11-0.38 max diff, >= 0.875 agreement). A
    # wrong scale, zero point or packing is off by whole logits.
    assert result["agreement"] >= 0.75, result
    assert 0 < result["max_logit_diff"] <= 0.6, result
    assert result["max_abs_logit"] > 3.0


def test_int8_mostly_agrees_with_float32(llama_dir: Path) -> None:
    ref = open_engine(llama_dir, prefill_chunk=16)
    cand = open_engine(llama_dir, prefill_chunk=16, dtype="int8")
    result = compare(ref, cand, [equivalence_prompt()], 16)
    # Measured on this random tiny model: identical 16-token text, max diff 0.59 (logits up
    # to 5.8). The tolerance: 3/4 of the greedy choices, one logit unit.
    assert result["agreement"] >= 0.75, result
    assert result["max_logit_diff"] <= 1.0, result


def _greedy(engine, rid: str, prompt: list[int], n: int, **kw: object) -> list[int]:  # type: ignore[no-untyped-def]
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True), **kw)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("num_prefix", [16, 29])
def test_int8_cached_prefix_equals_recompute(llama_dir: Path, num_prefix: int) -> None:
    prompt = equivalence_prompt()[:32]
    source = open_engine(llama_dir, dtype="int8")
    source.add_request("src", prompt, SamplingParams(max_tokens=1), retain_pages=True)
    while source.has_unfinished():
        source.step()
    pages = [source.export_page_bytes("src", i) for i in range(-(-num_prefix // 8))]
    assert len(pages[0]) == source.page_nbytes  # bf16 pages
    recomputed = _greedy(open_engine(llama_dir, dtype="int8"), "r", prompt, 8)
    cached = _greedy(
        open_engine(llama_dir, dtype="int8"),
        "c",
        prompt,
        8,
        prefix_pages=pages,
        num_prefix_tokens=num_prefix,
    )
    assert cached == recomputed


def test_quantized_engines_do_not_share_kv_with_bf16(llama_dir: Path) -> None:
    prints = {d: open_engine(llama_dir, dtype=d).model_fingerprint for d in ("bfloat16", "int8")}
    assert prints["bfloat16"] != prints["int8"]


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of .*'int8', 'int4'.*got 'int3'"):
        EngineConfig(dtype="int3")
    with pytest.raises(ValueError, match="got 'int3'"):
        precision("int3")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_store_flags(parser)
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'int3'"):
        parser.parse_args(["--dtype", "int3"])
    assert parser.parse_args(["--dtype", "int4"]).dtype == "int4"


def test_server_dtypes_are_the_engines() -> None:
    assert tuple(PRECISIONS) == DTYPES


def test_missing_kernel_is_named(llama_dir: Path) -> None:
    assert missing_kernel(8, torch.device("cpu")) is None
    assert missing_kernel(4, torch.device("cpu")) is None
    why = missing_kernel(8, torch.device("meta"))
    assert why is not None and "_weight_int8pack_mm" in why and "meta" in why
    spec, _ = load_spec(llama_dir)
    with pytest.raises(ModelLoadError, match=r"dtype int4 cannot load: .*_for_cpu"):
        load_weights(llama_dir, spec, torch.bfloat16, torch.device("meta"), quant=precision("int4"))


def test_int4_names_a_width_its_groups_do_not_divide() -> None:
    with pytest.raises(ValueError, match="divisible by the group size 32, got 48"):
        Int4Linear(nn.Linear(48, 8), torch.float32, 32)
