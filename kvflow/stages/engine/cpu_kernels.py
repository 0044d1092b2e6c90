"""The project's C kernels for the CPU, compiled and loaded once per process (one library).

`SOURCES` (cpu_gemv.c: the decode matrix-vector product; cpu_panel.c: the matrix product on
panel-packed weights; cpu_fused.c: the fused elementwise
steps of a decoder layer; cpu_attn.c: paged decode attention; cpu_prefill.c: paged
prefill attention; cpu_decode.c: a decode step's layers calling those in turn; `HEADERS`:
what they share) are
compiled together on first use with the system's C compiler
(`cc`, or `$CC`) for this CPU (`-march=native`, less what `$KVFLOW_KERNEL_ISA` takes away;
`-ffp-contract=off`, so that a product and a
sum written apart round apart, as torch's separate ops do) into a cache directory
(`$KVFLOW_KERNEL_DIR`, else `$XDG_CACHE_HOME/kvflow/kernels`, else `~/.cache/kvflow/kernels`),
named by a hash of the sources, the flags, the compiler and the CPU's model and flags, and
loaded with ctypes (calls release the GIL). It is loaded after torch, so its `libgomp.so.1`
is the one torch already loaded (one OpenMP runtime, torch's thread pool); where another
OpenMP runtime would be loaded, or there is no compiler, `library()` returns None and every
user keeps its torch path (logged once).
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
from pathlib import Path

import torch  # noqa: F401  (loaded first: its OpenMP runtime is the one the library links)

from kvflow.stages.engine.openmp import runtimes

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_gemv.c",
        "cpu_panel.c",
        "cpu_fused.c",
        "cpu_attn.c",
        "cpu_prefill.c",
        "cpu_decode.c",
    )
)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_simd.h", "cpu_kernels.h"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
ENV_DIR = "KVFLOW_KERNEL_DIR"
ENV_ISA = "KVFLOW_KERNEL_ISA"
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "generic": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
}
"""`KVFLOW_KERNEL_ISA`: the kernels' instruction set below what `-march=native` gives, so
that a machine with AVX-512 also builds and tests the AVX2 path ("avx2") and the plain loops
("generic"); unset or "native": the best this CPU has (each kernel has an AVX-512, an AVX2 +
FMA and a plain path, chosen when it is compiled)."""


def isa_flags() -> tuple[str, ...]:
    value = os.environ.get(ENV_ISA, "native")
    if value not in ISA_FLAGS:
        raise ValueError(f"{ENV_ISA} must be one of {tuple(ISA_FLAGS)}, got {value!r}")
    return ISA_FLAGS[value]


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def kernel_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvflow" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _build(cc: str, out: Path) -> None:
    """Compile the sources to `out` (atomically: a temporary file renamed into place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *FLAGS, *isa_flags(), "-o", tmp, *(str(s) for s in SOURCES), *LIBS],
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


def _load() -> ctypes.CDLL | None:
    if sys.platform != "linux" or not all(s.is_file() for s in (*SOURCES, *HEADERS)):
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: the CPU kernels are not used (torch and oneDNN instead)")
        return None
    named = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS))
    named += " ".join((cc, *FLAGS, *isa_flags(), *LIBS)).encode() + _cpu_identity()
    key = hashlib.sha256(named).hexdigest()[:16]
    path = kernel_dir() / f"cpu_kernels-{key}.so"
    before = runtimes()
    try:
        if not path.is_file():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels unavailable (%s): torch and oneDNN are used instead", detail)
        return None
    if len(runtimes()) > max(1, len(before)):
        log.warning("the CPU kernels would load a second OpenMP runtime: not used")
        return None
    log.info("CPU kernels loaded from %s", path)
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built or loaded here. Built once
    per process."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]
