"""A float32 matrix-vector product for the few rows of a decode step on the CPU (cpu_gemv.c).

A decode step at batch 1 reads every weight once; its time is the time to read them. oneDNN's
inner product read the weights of SmolLM2-135M's linears at ~20 GB/s here on 2 threads, while
a plain read (`sum` over each weight) ran at ~28 GB/s. `cpu_gemv.c` reads each weight row once,
in order, with AVX-512 FMAs (a plain loop elsewhere), the output rows split over torch's OpenMP
threads: ~28 GB/s, the plain read's rate (BENCHMARKS.md, docs/performance.md).

The kernel is compiled on first use with the system's C compiler (`cc`, or `$CC`) for this
CPU (`-march=native`) into a cache directory (`$KVFLOW_KERNEL_DIR`, else
`$XDG_CACHE_HOME/kvflow/kernels`, else `~/.cache/kvflow/kernels`), named by a hash of the
source, the flags, the compiler and the CPU's model and flags, and loaded with ctypes (the
call releases the GIL). It is loaded after torch, so its `libgomp.so.1` is the one torch
already loaded (one OpenMP runtime, torch's thread pool); where another OpenMP runtime would
be loaded, or there is no compiler, `gemv_kernel()` returns None and the linears keep oneDNN
(logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from kvflow.stages.engine.openmp import runtimes

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ENV_DIR = "KVFLOW_KERNEL_DIR"
MAX_ROWS = 8
"""Rows (tokens) up to which `gemv` is used; above, oneDNN's inner product (measured: the
kernel 1.4x oneDNN at 1 row, 1.1x at 8, 1.07x at 16 on a 2-core
AMD EPYC; above 8 rows the gain is small and prefill stays on oneDNN)."""

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

_lock = threading.Lock()
_loaded: dict[str, Gemv | None] = {}


def kernel_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvflow" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(cc: str, out: Path) -> None:
    """Compile the kernel to `out` (atomically: a temporary file renamed into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_identity() -> bytes:
    """The CPU's model and feature flags (Linux): `-march=native` builds for this CPU, so a
    cache directory shared between machines (a network home, a mounted volume) must not hand
    one CPU's build to another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    wanted = ("model name", "flags")
    lines = [ln for ln in info.splitlines() if ln.split(":", 1)[0].strip() in wanted]
    return "\n".join(sorted(set(lines))).encode()


def _load() -> Gemv | None:
    if sys.platform != "linux" or not SOURCE.is_file():
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: decode linears stay on oneDNN")
        return None
    named = SOURCE.read_bytes() + " ".join((cc, *FLAGS)).encode() + _cpu_identity()
    key = hashlib.sha256(named).hexdigest()[:16]
    path = kernel_dir() / f"cpu_gemv-{key}.so"
    before = runtimes()
    try:
        if not path.is_file():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("cpu_gemv kernel unavailable (%s): decode linears stay on oneDNN", detail)
        return None
    if len(runtimes()) > max(1, len(before)):
        log.warning("cpu_gemv kernel would load a second OpenMP runtime: not used")
        return None
    fn = lib.kvflow_gemv
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 4

    def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, (n, k) = x.shape[0], weight.shape
        y = torch.empty((m, n), dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        fn(x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    log.info("cpu_gemv kernel loaded from %s", path)
    return gemv


def gemv_kernel() -> Gemv | None:
    """`gemv(x [M, K], weight [N, K], bias [N] | None) -> [M, N]` for contiguous float32 CPU
    tensors, or None where the kernel cannot be built or loaded here. Built once per process."""
    with _lock:
        if "gemv" not in _loaded:
            _loaded["gemv"] = _load()
        return _loaded["gemv"]


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of `x` by `weight` goes to the kernel: CPU float32, at most
    `MAX_ROWS` rows, both contiguous."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
    )
