"""The panel-packed float32 product (cpu_panel.py): the packing, products equal to F.linear's
on every path the kernel is built for, a row's bits independent of its batch and the thread
count, and the "panel" linear backend sending every row count to it."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvflow.stages.engine import cpu_panel, onednn_linear
from kvflow.stages.engine.cpu_panel import PANEL, pack, panel_applies
from kvflow.stages.engine.onednn_linear import (
    ENV_LINEAR,
    OneDNNDenseLinear,
    default_copy_form,
    use_onednn_linears,
)
from tests.stages.engine.conftest import ProjAndHead, needs_onednn_kernel

needs_kernel = needs_onednn_kernel

# N: a whole panel, several, and a partial last one; K: odd, short and long
SHAPES = ((16, 8), (37, 13), (100, 64), (576, 576), (960, 1536), (5, 3))
ROWS = (0, 1, 2, 5, 6, 7, 13, 40)


def test_pack_lays_out_panels_of_16_outputs_zero_past_n() -> None:
    w = torch.arange(37 * 5, dtype=torch.float32).view(37, 5)
    p = pack(w)
    assert p.shape == (3, 5, PANEL) and p.is_contiguous()
    for n in range(37):
        assert torch.equal(p[n // PANEL, :, n % PANEL], w[n])
    assert not p[2, :, 37 - 32 :].any()  # outputs 37..47 do not exist
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        pack(w.to(torch.float64))
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        pack(w.view(-1))


def _bound(lib: ctypes.CDLL) -> cpu_panel.PanelGemm:
    return cpu_panel.bind(lib)


@needs_kernel
def test_panel_gemm_equals_f_linear(isa_library: ctypes.CDLL) -> None:
    """As loaded, and built for AVX2 and for plain loops (`isa_library`), on 1 and 2
    threads: within float32 rounding of F.linear, with and without a bias."""
    gemm = _bound(isa_library)
    gen = torch.Generator().manual_seed(0)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, k in SHAPES:
                w = torch.randn(n, k, generator=gen)
                b = torch.randn(n, generator=gen)
                packed = pack(w)
                for rows in ROWS:
                    x = torch.randn(rows, k, generator=gen)
                    for bias in (None, b):
                        got = gemm(x, packed, bias, n)
                        expected = torch.nn.functional.linear(x, w, bias)
                        assert got.shape == expected.shape and got.dtype == torch.float32
                        # one running sum of k float32 products: its rounding grows with k
                        atol = 2e-6 * k
                        torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch_or_threads() -> None:
    """Each output is one running sum over k: a row alone, in a batch of 13 (two blocks of 6
    and one left over) and on 1 or 2 threads gives the same bits."""
    gemm = cpu_panel.panel_kernel()
    assert gemm is not None
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    packed = pack(w)
    x = torch.randn(13, 576, generator=gen)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = gemm(x, packed, b, 960)
        torch.set_num_threads(1)
        alone = torch.cat([gemm(x[i : i + 1].contiguous(), packed, b, 960) for i in range(13)])
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(batch, alone)


def test_panel_applies_to_contiguous_float32_rows_of_its_k() -> None:
    packed = torch.zeros(2, 4, PANEL)
    assert panel_applies(torch.zeros(3, 4), packed)
    assert panel_applies(torch.zeros(600, 4), packed)  # every row count
    assert not panel_applies(torch.zeros(3, 5), packed)
    assert not panel_applies(torch.zeros(4, 3).t(), packed)
    assert not panel_applies(torch.zeros(1, 3, 4), packed)
    assert not panel_applies(torch.zeros(3, 4, dtype=torch.bfloat16), packed)


@needs_kernel
def test_panel_backend_sends_every_row_count_to_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLOW_LINEAR=panel: the decoder's linears and the lm_head get a panel copy and every
    row count, a decode step's and a prefill chunk's, goes to it: the same bits as the
    kernel on that copy, F.linear's within float32 rounding."""
    monkeypatch.setenv(ENV_LINEAR, "panel")
    gen = torch.Generator().manual_seed(2)
    holder = ProjAndHead(out=100)  # a partial last panel
    weight, bias = holder.proj.weight, holder.proj.bias
    head_weight = holder.lm_head.weight
    assert use_onednn_linears(holder) == 2
    proj, head = holder.proj, holder.lm_head
    assert isinstance(proj, OneDNNDenseLinear) and isinstance(head, OneDNNDenseLinear)
    assert proj.panel_weight is not None and proj.has_copy and "panel" in repr(proj)
    assert head.panel_weight is not None and head.has_copy and head.weight is head_weight
    assert proj.weight is weight
    gemm = cpu_panel.panel_kernel()
    assert gemm is not None
    with torch.inference_mode():
        for rows in (1, 8, 17, 300):
            x = torch.randn(rows, 64, generator=gen)
            got = proj(x)
            assert torch.equal(got, gemm(x, proj.panel_weight, bias, 100))
            torch.testing.assert_close(
                got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4
            )
        strided = torch.randn(64, 5, generator=gen).t()  # not contiguous: oneDNN's path
        torch.testing.assert_close(
            proj(strided), torch.nn.functional.linear(strided, weight, bias), rtol=1e-5, atol=1e-4
        )


def test_the_default_copy_is_the_panel_where_its_vector_kernel_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_LINEAR, raising=False)
    for vendor in ("GenuineIntel", "AuthenticAMD", ""):
        assert default_copy_form(vendor, fast_panels=True) == "panel"
    assert default_copy_form("AuthenticAMD", fast_panels=False) == "prepacked"
    monkeypatch.setattr(onednn_linear, "panel_fast", lambda: True)
    assert default_copy_form("GenuineIntel") == "panel"
    monkeypatch.setattr(onednn_linear, "panel_fast", lambda: False)
    assert default_copy_form("AuthenticAMD") == "prepacked"


def test_no_kernel_library_falls_back_to_the_prepacked_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVFLOW_LINEAR=panel where the library cannot be built: oneDNN's prepacked copy."""
    monkeypatch.setenv(ENV_LINEAR, "panel")
    monkeypatch.setattr(onednn_linear, "panel_kernel", lambda: None)
    monkeypatch.setattr(onednn_linear, "gemv_kernel", lambda: None)
    holder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    use_onednn_linears(holder)
    first = holder[0]
    assert isinstance(first, OneDNNDenseLinear)
    assert first.panel_weight is None and first.prefill_weight is not None
    with pytest.raises(ValueError, match="panel kernel"):
        OneDNNDenseLinear(torch.nn.Linear(8, 16), copy="panel", panel=None)
