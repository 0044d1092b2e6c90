"""Engine test fixtures: a tiny demo model written once per session."""

from __future__ import annotations

import ctypes
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import Engine, EngineConfig, cpu_attn, cpu_kernels, write_demo_model
from kvflow.stages.engine.cpu_attn import PagedKernel


@pytest.fixture
def kernel() -> PagedKernel:
    """The paged attention kernels (cpu_attn), built for this CPU."""
    bound = cpu_attn.kernel()
    assert bound is not None
    return bound


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """Put torch's thread count back after a test that sets it."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama made by transformers, with varied weights (greedy tokens differ)."""
    from tests.stages.engine.hf_models import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("hf-llama"), "llama", seed=1)


def open_engine(model_dir: Path, **overrides: object) -> Engine:
    """An fp32 engine with small pages so that tests cross page boundaries."""
    options: dict[str, object] = {
        "block_size": 8,
        "num_pages": 64,
        "prefill_chunk": 64,
        "return_logits": True,
    }
    options.update(overrides)
    return Engine.open(model_dir, EngineConfig(**options))  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def smol_dir(real_model: Path) -> Path:
    """The default model (SmolLM2-135M-Instruct): the session's one import (``real_model``)."""
    return real_model


def cpu_has(*flags: str) -> bool:
    """Whether this CPU reports every one of `flags` (/proc/cpuinfo; False where unreadable)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    return set(flags) <= set(line.split(":", 1)[-1].split())


@pytest.fixture(scope="session", params=["native", "avx2", "generic"])
def isa_library(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> ctypes.CDLL:
    """The kernels' library as this process loads it ("native"), and built without AVX-512
    (`KVFLOW_KERNEL_ISA`): the AVX2 + FMA paths ("avx2") and the plain loops ("generic"), so
    that every path is tested on a CPU that has AVX-512 too."""
    isa = request.param
    if isa == "native":
        lib = cpu_kernels.library()
    else:
        if platform.machine() not in ("x86_64", "AMD64") or not cpu_has("avx2", "fma"):
            pytest.skip("x86-64 with AVX2 and FMA only")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_kernels.ENV_ISA, isa)
            mp.setenv(cpu_kernels.ENV_DIR, str(tmp_path_factory.mktemp(f"kernels-{isa}")))
            lib = cpu_kernels._load()
    assert lib is not None
    return lib


class ProjAndHead(torch.nn.Module):
    """A decoder-like float32 linear with a bias (`proj`, 64 -> `out`) and an lm_head
    (`out` -> 200, no bias): the decoder's linears get every backend's copy, the lm_head only
    the panels' (`onednn_linear.copies_lm_head`)."""

    def __init__(self, out: int = 96) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, out, bias=True)
        self.lm_head = torch.nn.Linear(out, 200, bias=False)


needs_onednn_kernel = pytest.mark.skipif(
    sys.platform != "linux"
    or shutil.which("cc") is None
    or not torch.backends.mkldnn.is_available(),
    reason="the kernel is built on Linux with a C compiler, beside oneDNN",
)
"""The CPU kernels' tests beside oneDNN's linears (test_cpu_gemv.py, test_cpu_panel.py)."""
