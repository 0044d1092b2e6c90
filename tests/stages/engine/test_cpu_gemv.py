"""The float32 decode matrix-vector kernel (cpu_gemv.py): its products equal F.linear's, the
oneDNN dense linear sends a decode step's rows to it (and a prefill chunk's not), and it is
built once into its cache directory."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import cpu_gemv, cpu_kernels, meminfo, onednn_linear, openmp
from kvflow.stages.engine.onednn_linear import (
    ENV_LINEAR,
    PREPACK_SHARE,
    OneDNNDenseLinear,
    default_copy_form,
    linear_backend,
    onednn_applies,
    prepack_planned,
    use_onednn_linears,
)
from tests.stages.engine.conftest import ProjAndHead, cpu_has, needs_onednn_kernel

needs_kernel = needs_onednn_kernel


@needs_kernel
def test_gemv_equals_f_linear() -> None:
    gemv = cpu_gemv.gemv_kernel()
    assert gemv is not None
    gen = torch.Generator().manual_seed(0)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # K: whole 64-blocks, 16-blocks and a masked tail; N below and above the split
            for n, k in ((40, 96), (100, 33), (960, 576), (576, 1536), (7, 5)):
                w = torch.randn(n, k, generator=gen)
                b = torch.randn(n, generator=gen)
                for rows in (0, 1, 3, cpu_gemv.MAX_ROWS):
                    x = torch.randn(rows, k, generator=gen)
                    for bias in (None, b):
                        got = gemv(x, w, bias)
                        expected = torch.nn.functional.linear(x, w, bias)
                        assert got.shape == expected.shape and got.dtype == torch.float32
                        # float32 products summed in another order: within float32 rounding
                        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), (
                            n,
                            k,
                            rows,
                            (got - expected).abs().max(),
                        )
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_blocking_off_is_one_dot_per_output_and_row() -> None:
    """`kvflow_gemv_blocked_from` with blocking from more rows than given (what the gemv
    benchmark measures as the kernel before blocking) gives F.linear's values too, and the
    same bits as `kvflow_gemv` where that does not block (1 and 2 rows)."""
    lib = cpu_kernels.library()
    assert lib is not None
    fn = lib.kvflow_gemv_blocked_from
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5
    gemv = cpu_gemv.gemv_kernel()
    assert gemv is not None
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(130, 576, generator=gen), torch.randn(130, generator=gen)
    for rows in (1, 2, 5, 8):
        x = torch.randn(rows, 576, generator=gen)
        y = torch.empty(rows, 130)
        fn(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), rows, 130, 576, 2, rows + 1)
        assert torch.allclose(y, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
        if rows <= 2:
            assert torch.equal(y, gemv(x, w, b))


def _check_rows_blocks_and_tails(gemv: cpu_gemv.Gemv, seed: int) -> None:
    """Every row count 1..2 * MAX_ROWS + 1 (whole 4-row blocks and remainders, beyond
    `MAX_ROWS` too), K with and without a 16-float tail, N with and without a 4-output tail
    (and N split over the threads on both sides of it), with and without a bias: F.linear's
    values within float32 summation-order rounding."""
    gen = torch.Generator().manual_seed(seed)
    for n, k in ((64, 16), (67, 31), (130, 576), (203, 1536), (1030, 47), (3, 20)):
        w = torch.randn(n, k, generator=gen)
        b = torch.randn(n, generator=gen)
        for rows in range(1, 2 * cpu_gemv.MAX_ROWS + 2):
            x = torch.randn(rows, k, generator=gen)
            for bias in (None, b):
                got = gemv(x, w, bias)
                expected = torch.nn.functional.linear(x, w, bias)
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), (
                    f"{n}x{k} M={rows}",
                    (got - expected).abs().max(),
                )


@needs_kernel
def test_gemv_blocks_of_rows_and_tails_equal_f_linear() -> None:
    gemv = cpu_gemv.gemv_kernel()
    assert gemv is not None
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            _check_rows_blocks_and_tails(gemv, seed=10 + threads)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_gemv_portable_build_equals_f_linear(
    isa: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel built without AVX-512 (`KVFLOW_KERNEL_ISA`): AVX2 + FMA (4 x 2 blocks), or
    the plain loop."""
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
        pytest.skip("x86-64 with AVX2 and FMA only")
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path / "kernels"))
    monkeypatch.setenv(cpu_kernels.ENV_ISA, isa)
    lib = cpu_kernels._load()
    assert lib is not None
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _check_rows_blocks_and_tails(cpu_gemv.bind(lib), seed=20)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_dense_linear_sends_decode_rows_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_LINEAR, "gemv")  # the decode kernel, no prepacked copy
    assert onednn_applies(torch.float32, torch.device("cpu"))  # a loaded model is swapped
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(64, 80, bias=True)
    holder = torch.nn.Sequential(linear)
    assert use_onednn_linears(holder) == 1
    dense = holder[0]
    assert isinstance(dense, OneDNNDenseLinear) and dense.gemv is not None
    calls: list[int] = []
    kernel = dense.gemv

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, w, b)

    dense.gemv = counting
    with torch.inference_mode():
        for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 64):
            x = torch.randn(rows, 64, generator=gen)
            expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
            assert torch.allclose(dense(x), expected, rtol=1e-5, atol=1e-4)
        # a non-contiguous input goes to oneDNN
        x = torch.randn(64, 2, generator=gen).t()
        assert torch.allclose(
            dense(x),
            torch.nn.functional.linear(x, linear.weight, linear.bias),
            rtol=1e-5,
            atol=1e-4,
        )
    assert calls == [1, cpu_gemv.MAX_ROWS]
    monkeypatch.setenv(ENV_LINEAR, "onednn")  # oneDNN alone: no kernel
    other = torch.nn.Sequential(torch.nn.Linear(64, 80))
    use_onednn_linears(other)
    assert isinstance(other[0], OneDNNDenseLinear) and other[0].gemv is None


@needs_kernel
def test_kernel_built_once_into_its_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path / "kernels"))
    assert cpu_kernels.kernel_dir() == tmp_path / "kernels"
    lib = cpu_kernels._load()
    assert lib is not None
    assert lib.kvflow_gemv and lib.kvflow_add_rms_norm and lib.kvflow_rope and lib.kvflow_silu_mul
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-")
    stamp = built[0].stat().st_mtime_ns
    assert cpu_kernels._load() is not None  # loaded again, not rebuilt
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").iterdir()] == [stamp]
    # one OpenMP runtime in the process: torch's
    assert len(openmp.runtimes()) <= 1


def test_no_compiler_keeps_onednn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_DIR, str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_kernels._load() is None
    assert not (tmp_path / "kernels").exists()


def test_gemv_applies_only_to_few_contiguous_float32_rows() -> None:
    w = torch.zeros(8, 4)
    assert cpu_gemv.gemv_applies(torch.zeros(1, 4), w)
    assert cpu_gemv.gemv_applies(torch.zeros(cpu_gemv.MAX_ROWS, 4), w)
    assert not cpu_gemv.gemv_applies(torch.zeros(cpu_gemv.MAX_ROWS + 1, 4), w)
    assert not cpu_gemv.gemv_applies(torch.zeros(1, 4, dtype=torch.bfloat16), w)
    assert not cpu_gemv.gemv_applies(torch.zeros(4, 2).t(), w)
    assert not cpu_gemv.gemv_applies(torch.zeros(1, 1, 4), w)
    assert not cpu_gemv.gemv_applies(torch.zeros(1, 4), torch.zeros(4, 8).t())


@needs_kernel
def test_prepacked_backend_prefill_rows_on_a_packed_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFLOW_LINEAR=prepacked: decode rows on the kernel (dense weight), prefill rows on a
    oneDNN-prepared copy with the same bits as the dense inner product; the lm_head keeps
    no copy; a bias is added."""
    monkeypatch.setenv(ENV_LINEAR, "prepacked")
    gen = torch.Generator().manual_seed(2)
    holder = ProjAndHead()
    weight, bias = holder.proj.weight, holder.proj.bias
    assert use_onednn_linears(holder) == 2
    proj, head = holder.proj, holder.lm_head
    assert isinstance(proj, OneDNNDenseLinear) and isinstance(head, OneDNNDenseLinear)
    assert proj.prefill_weight is not None and proj.gemv is not None
    assert head.prefill_weight is None
    assert proj.weight is weight  # the dense parameter stays (decode reads it)
    with torch.inference_mode():
        for rows in (1, cpu_gemv.MAX_ROWS + 1, 512):
            x = torch.randn(rows, 64, generator=gen)
            dense = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
            got = proj(x)
            if rows > cpu_gemv.MAX_ROWS:
                assert torch.equal(got, dense)
            torch.testing.assert_close(
                got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4
            )


class _Holder(torch.nn.Module):
    """Two decoder-like linears and an lm_head (float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 96, bias=True)
        self.down = torch.nn.Linear(96, 64, bias=False)
        self.lm_head = torch.nn.Linear(64, 200, bias=False)


COPY_BYTES = 4 * (64 * 96 + 96 * 64)  # proj and down; the lm_head's copy only in panels
HEAD_BYTES = 4 * 64 * 200


def test_prepack_planned_decides_by_dtype_memory_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_LINEAR, raising=False)
    copy = 425 << 20
    assert prepack_planned("float32", copy, PREPACK_SHARE * copy)  # fits: the default
    assert prepack_planned("float32", copy, None)  # memory unknown
    assert not prepack_planned("float32", copy, PREPACK_SHARE * copy - 1)  # too little memory
    for dtype in ("bfloat16", "float16", "int8", "int4"):
        assert not prepack_planned(dtype, copy, 1 << 40)
    monkeypatch.setenv(ENV_LINEAR, "gemv")  # the way out
    assert not prepack_planned("float32", copy, 1 << 40)
    monkeypatch.setenv(ENV_LINEAR, "prepacked")  # asked for: whatever the memory
    assert prepack_planned("float32", copy, 1)
    monkeypatch.setenv(ENV_LINEAR, "bogus")
    with pytest.raises(ValueError, match=ENV_LINEAR):
        prepack_planned("float32", copy, None)


def test_the_default_copy_form_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, without the panel kernel's vector form (test_cpu_panel.py has the other case),
    the prefill copy is MKL's transposed weight on Intel CPUs (with torch's MKL) and
    oneDNN's prepacked weight on the others; the vendor is /proc/cpuinfo's."""
    monkeypatch.delenv(ENV_LINEAR, raising=False)
    monkeypatch.setattr(onednn_linear, "panel_fast", lambda: False)
    mkl = torch.backends.mkl.is_available()
    assert default_copy_form("GenuineIntel") == ("transposed" if mkl else "prepacked")
    for vendor in ("AuthenticAMD", "HygonGenuine", ""):
        assert default_copy_form(vendor) == "prepacked"
    real = onednn_linear.cpu_vendor
    monkeypatch.setattr(onednn_linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert linear_backend() == "prepacked"
    monkeypatch.setenv(ENV_LINEAR, "transposed")  # asked for: whatever the CPU
    assert linear_backend() == "transposed"
    if Path("/proc/cpuinfo").is_file():
        real.cache_clear()
        named = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if "vendor_id" in ln]
        assert real() == (named[0].split(":", 1)[1].strip() if named else "")


@needs_kernel
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", "panel"])
def test_default_copies_where_memory_allows(monkeypatch: pytest.MonkeyPatch, vendor: str) -> None:
    """KVFLOW_LINEAR unset: a copy where it takes at most 1/PREPACK_SHARE of the memory
    available, prefill rows on it (on an Intel CPU a transposed copy through MKL's plain
    sgemm, `addmm`; elsewhere oneDNN's prepacked weight; with the panel kernel's vector
    form, "panel", every row on panels, the lm_head's too, counted in the copy's size), the
    same outputs as the no-copy (gemv) backend's up to float32 rounding, decode rows the same
    bits (but on panels); with less memory, the gemv backend (no copy)."""
    monkeypatch.delenv(ENV_LINEAR, raising=False)
    monkeypatch.setattr(onednn_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(onednn_linear, "panel_fast", lambda: vendor == "panel")
    form = default_copy_form()
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)  # the linears' initial weights
    fits, tight = _Holder(), _Holder()
    tight.load_state_dict(fits.state_dict())
    copy_bytes = COPY_BYTES + (HEAD_BYTES if form == "panel" else 0)
    for model, available in ((fits, PREPACK_SHARE * copy_bytes), (tight, copy_bytes)):
        monkeypatch.setattr(onednn_linear, "available_at_start", lambda a=available: a)
        assert use_onednn_linears(model) == 3
    for name in ("proj", "down"):
        mine = getattr(fits, name)
        if form == "transposed":
            assert mine.transposed_weight is not None and mine.prefill_weight is None
            assert torch.equal(mine.transposed_weight, mine.weight.t())
            assert mine.transposed_weight.is_contiguous() and mine.has_copy
        elif form == "panel":
            assert mine.panel_weight is not None and mine.prefill_weight is None
            assert mine.has_copy and mine.panel is not None
        else:
            assert mine.prefill_weight is not None and mine.transposed_weight is None
            assert mine.has_copy
        assert not getattr(tight, name).has_copy
        assert mine.gemv is not None and getattr(tight, name).gemv is not None
    assert fits.lm_head.has_copy == (form == "panel") and not tight.lm_head.has_copy
    with torch.inference_mode():
        for rows in (1, cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1, 512):
            x, h = torch.randn(rows, 64, generator=gen), torch.randn(rows, 96, generator=gen)
            for name, xin in (("proj", x), ("down", h), ("lm_head", x)):
                mine, other = getattr(fits, name), getattr(tight, name)
                got = mine(xin)
                if form == "panel":  # every row count on the panels, the lm_head's too
                    assert mine.panel is not None and mine.panel_weight is not None
                    panels = (
                        mine(xin),
                        mine.panel(xin, mine.panel_weight, mine.bias, mine.out_features),
                    )
                    assert torch.equal(*panels)
                    torch.testing.assert_close(got, other(xin), rtol=1e-5, atol=1e-5)
                    continue
                if rows <= cpu_gemv.MAX_ROWS or name == "lm_head":  # no copy involved
                    assert torch.equal(got, other(xin))
                    continue
                bias, weight_t = mine.bias, mine.weight.t().contiguous()
                if form == "prepacked":  # oneDNN's inner product: the dense one's bits
                    dense = torch.ops.mkldnn._linear_pointwise(
                        xin, mine.weight, bias, "none", [], ""
                    )
                    assert torch.equal(got, dense)
                elif bias is None:
                    assert torch.equal(got, torch.mm(xin, weight_t))
                else:
                    assert torch.equal(got, torch.addmm(bias, xin, weight_t))
                torch.testing.assert_close(got, other(xin), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(
                    got, torch.nn.functional.linear(xin, mine.weight, bias), rtol=1e-5, atol=1e-5
                )


def test_a_copy_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy form other than the two is refused, naming them; KVFLOW_LINEAR=transposed asks
    for the copy whatever the memory, as prepacked does."""
    with pytest.raises(ValueError, match="transposed"):
        OneDNNDenseLinear(torch.nn.Linear(4, 4), None, "blocked")
    monkeypatch.setenv(ENV_LINEAR, "transposed")
    assert prepack_planned("float32", 1 << 30, 1)
    holder = _Holder()
    assert use_onednn_linears(holder) == 3
    assert holder.proj.transposed_weight is not None and not holder.lm_head.has_copy


def test_the_plan_and_the_engines_read_memory_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory plan and every engine decide by the same reading (the process's first), so
    engines loaded later, after other engines' weights, decide as the printed plan did."""
    readings = iter([8 << 30, 1 << 30, 1 << 20])
    monkeypatch.setattr(meminfo, "available_memory_bytes", lambda: next(readings))
    meminfo.available_at_start.cache_clear()
    try:
        assert [meminfo.available_at_start() for _ in range(3)] == [8 << 30] * 3
    finally:
        meminfo.available_at_start.cache_clear()
