"""The fused float32 elementwise kernels (cpu_fused.py) against the torch ops they replace:
RoPE and the residual add bit for bit, RMSNorm and SiLU * up to float32 rounding; on random
shapes (odd widths, 1 row and many, strided rows as the fused projections' views arrive);
and the model's forward with them equal to its forward without (KVFLOW_FUSED=0)."""

from __future__ import annotations

import ctypes
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvflow.stages.engine import SamplingParams, cpu_fused, cpu_kernels
from kvflow.stages.engine.cpu_fused import ENV_FUSED, FusedKernels, fused_kernels
from kvflow.stages.engine.model import RMSNorm
from kvflow.stages.engine.rope import Rotary, apply_rotary
from kvflow.stages.engine.spec import RopeSpec
from tests.stages.engine.conftest import open_engine

needs_kernel = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("cc") is None,
    reason="the kernels are built on Linux with a C compiler",
)

THREADS = (1, 2)
ROWS = (1, 3, 17, 600)


@pytest.fixture
def fused(isa_library: ctypes.CDLL) -> FusedKernels:
    """The kernels as loaded, and built for AVX2 and for plain loops (`isa_library`)."""
    return FusedKernels(isa_library)


def _threads(n: int) -> None:
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _restore_threads():  # type: ignore[no-untyped-def]
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@needs_kernel
def test_add_rms_norm_equals_torch(fused: FusedKernels) -> None:
    gen = torch.Generator().manual_seed(0)
    for threads in THREADS:
        _threads(threads)
        for n in (576, 5, 16, 33, 1000):
            norm = RMSNorm(n, 1e-5)
            norm.weight.data = torch.randn(n, generator=gen)
            for rows in ROWS:
                x = torch.randn(rows, n, generator=gen) * 3
                # delta as a strided view (rows of a wider tensor), and none
                delta = torch.randn(rows, n + 7, generator=gen)[:, 3 : 3 + n]
                for d in (delta, None):
                    expected_x = x + d if d is not None else x.clone()
                    expected = norm(expected_x)
                    got_x, got = fused.add_rms_norm(x.clone(), d, norm.weight, norm.eps)
                    assert torch.equal(got_x, expected_x)  # the add: torch's bits
                    assert got.shape == expected.shape and got.is_contiguous()
                    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


@needs_kernel
def test_add_rms_norm_adds_in_place_and_checks_shapes(fused: FusedKernels) -> None:
    x, delta, w = torch.ones(2, 8), torch.full((2, 8), 2.0), torch.ones(8)
    out_x, out = fused.add_rms_norm(x, delta, w, 1e-6)
    assert out_x is x and torch.equal(x, torch.full((2, 8), 3.0))
    torch.testing.assert_close(out, torch.ones(2, 8))
    with pytest.raises(ValueError, match="delta"):
        fused.add_rms_norm(x, torch.ones(3, 8), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        fused.add_rms_norm(x, None, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="x must be float32"):
        fused.add_rms_norm(torch.ones(8, 2).t(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x must be float32"):
        fused.add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, w, 1e-6)


@needs_kernel
def test_rope_in_place_equals_apply_rotary(fused: FusedKernels) -> None:
    gen = torch.Generator().manual_seed(1)
    for threads in THREADS:
        _threads(threads)
        for d, heads in ((64, 12), (128, 3), (6, 1), (34, 5)):
            rotary = Rotary(RopeSpec(theta=10000.0), d, torch.device("cpu"))
            for rows in ROWS:
                positions = torch.randint(0, 4096, (rows,), generator=gen)
                cos, sin = rotary.cos_sin(positions, torch.float32)
                # as the qkv projection's output arrives: q/k heads, then v, per row
                qkv = torch.randn(rows, (heads + 2) * d, generator=gen)
                qk = qkv[:, : heads * d].unflatten(-1, (heads, d))
                expected = apply_rotary(qk, cos, sin)
                v_before = qkv[:, heads * d :].clone()
                got = fused.rope_(qk, cos, sin)
                assert got.data_ptr() == qk.data_ptr()  # in place
                assert torch.equal(got, expected), (d, heads, rows)
                assert torch.equal(qkv[:, heads * d :], v_before)  # v untouched


@needs_kernel
def test_rope_checks_its_tables(fused: FusedKernels) -> None:
    x = torch.zeros(2, 3, 8)
    cos = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="cos"):
        fused.rope_(x, torch.zeros(3, 1, 8), cos)
    with pytest.raises(ValueError, match="signed_sin"):
        fused.rope_(x, cos, torch.zeros(2, 1, 16)[:, :, ::2])  # not contiguous
    with pytest.raises(ValueError, match="even d"):
        fused.rope_(torch.zeros(2, 3, 7), cos[:, :, :7], cos[:, :, :7])


@needs_kernel
def test_silu_mul_equals_torch(fused: FusedKernels) -> None:
    gen = torch.Generator().manual_seed(2)
    for threads in THREADS:
        _threads(threads)
        for i in (1536, 1, 15, 17, 100):
            for rows in ROWS:
                gate_up = torch.randn(rows, 2 * i, generator=gen) * 4
                gate, up = gate_up.chunk(2, dim=-1)
                expected = F.silu(gate) * up
                got = fused.silu_mul(gate_up)
                assert got.shape == expected.shape and got.is_contiguous()
                torch.testing.assert_close(got, expected, rtol=3e-6, atol=1e-7)
                # strided rows: a slice of a wider output
                wide = torch.randn(rows, 2 * i + 5, generator=gen)[:, : 2 * i]
                g2, u2 = wide.chunk(2, dim=-1)
                torch.testing.assert_close(
                    fused.silu_mul(wide), F.silu(g2) * u2, rtol=3e-6, atol=1e-7
                )


@needs_kernel
def test_silu_at_the_ends_of_exp(fused: FusedKernels) -> None:
    """Large inputs (e^-x overflows, underflows) give torch's values, infinities and NaN
    included."""
    values = [-200.0, -104.0, -89.0, -88.0, -87.5, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 89.0]
    values += [200.0, float("inf"), float("-inf")]
    g = torch.tensor(values)
    gate_up = torch.cat((g, torch.ones_like(g)))[None, :]
    got = fused.silu_mul(gate_up)[0]
    expected = F.silu(g)
    torch.testing.assert_close(got, expected, rtol=3e-6, atol=1e-30, equal_nan=True)
    nan = fused.silu_mul(torch.tensor([[float("nan"), 1.0]]))
    assert torch.isnan(nan).all()


def test_fused_kernels_only_for_cpu_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FUSED, raising=False)
    assert fused_kernels(torch.zeros(1, dtype=torch.bfloat16)) is None
    assert fused_kernels(torch.zeros(1, device="meta")) is None
    assert fused_kernels(torch.zeros(1)) is cpu_fused.kernels()
    monkeypatch.setenv(ENV_FUSED, "0")
    assert fused_kernels(torch.zeros(1)) is None
    monkeypatch.setenv(ENV_FUSED, "yes")
    with pytest.raises(ValueError, match=ENV_FUSED):
        fused_kernels(torch.zeros(1))


@needs_kernel
def test_engine_logits_with_and_without_the_kernels(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill in chunks then decode steps: the same greedy tokens and logits to float32
    rounding with the kernels as with torch's ops (KVFLOW_FUSED=0)."""
    prompt = [(7 * i + 3) % 200 + 5 for i in range(40)]
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(ENV_FUSED, flag)
        engine = open_engine(llama_dir, prefill_chunk=16)
        engine.add_request("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == "r"]
        tokens = [t for o in outs for t in o.new_token_ids]
        logits = torch.cat([o.logits for o in outs if o.logits is not None])
        runs[flag] = tokens, logits
    assert runs["1"][0] == runs["0"][0] and len(runs["1"][0]) == 6
    torch.testing.assert_close(runs["1"][1], runs["0"][1], rtol=1e-4, atol=1e-4)


def test_unknown_fused_setting_fails_at_load(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_FUSED, "yes")
    with pytest.raises(ValueError, match=ENV_FUSED):
        open_engine(tiny_dir)


def test_unknown_kernel_isa_fails_at_load(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_ISA, "avx3")
    with pytest.raises(ValueError, match="KVFLOW_KERNEL_ISA must be one of"):
        open_engine(tiny_dir)
