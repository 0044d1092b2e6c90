"""torch's OpenMP threads in a serving process: who has a team, and how its threads wait.

GNU OpenMP (libgomp, torch's runtime on Linux) keeps a team of threads for every thread that
ever ran a parallel region with more than one thread, and counts all of them ("managed
threads"). A thread that waits at a barrier spins ~300,000 times (a few ms) before it sleeps
in the kernel, unless the managed threads outnumber the process's CPUs: then it spins only
~100 times ("throttled", libgomp's manual on ``GOMP_SPINCOUNT``). In a server the weights
load on the main thread and the forward passes run on an engine worker thread, so there were
two teams and every barrier of every forward pass slept: on 2 cores a 512-token prefill took
~1.2x and a batch-1 decode step ~1.4x the time of the same work with one team
(docs/performance.md, "OpenMP teams"). Spinning is right only while the engine has the cores:
when another process runs, a spinning thread burns the time slice its partner needs, and a
prefill took 1.6-2x longer than with sleeping waits.

So this module decides both:

- **One team per engine.** ``reserve()`` makes 1 thread the process's default
  (``torch.set_num_threads(1)``: every thread's first parallel region starts from it), so
  only engine worker threads, which set their own count (``set_thread_count``), build teams.
  MKL (torch's float32 matrix products, ``torch.mm`` / ``addmm``) keeps a count of its own,
  which ``torch.set_num_threads(1)`` set to 1 for the whole process and
  ``omp_set_num_threads`` does not change: ``set_thread_count`` also sets MKL's count for
  its thread (``mkl_set_num_threads_local``), else an engine thread's MKL products run on
  one thread (a 1,024 x 576 x 3,072 product took 23 against 12 ms on 2 cores).
- **Spin while the cores are the engine's, sleep while they are not** (``Waiting``, one per
  process). Each engine worker reports its steps' CPU and wall time (``SpinControl``): a
  step whose thread had the CPU for less than ``BUSY_SHARE`` of its wall time was waiting
  for a core (or for the GIL). Then the process sleeps at barriers: a keeper thread holds a
  team of ``cores`` threads, which makes the managed threads outnumber the CPUs (libgomp
  throttles). When the steps have their cores again the keeper exits and its team with it.

``KVFLOW_OMP_WAIT`` = ``adaptive`` (default), ``sleep`` (always throttled: the behaviour
before this module) or ``spin`` (never). Where torch's runtime is not libgomp (another
OpenMP, or none), counts go through ``torch.set_num_threads`` and waiting is left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_WAIT = "KVFLOW_OMP_WAIT"
WAIT_MODES = ("adaptive", "sleep", "spin")
WINDOW_S = 1.0  # of step wall time per decision
BUSY_SHARE = 0.8  # a window's thread CPU / wall below this: the cores were not the engine's
PROBE_AFTER = 4  # contended windows while sleeping before one window spinning (a probe)
PROBE_MAX = 32  # the most windows between probes (doubled after each probe found contention)

_lock = threading.Lock()
_gomp: list[ctypes.CDLL | None] = []  # resolved once: torch's libgomp, or None
_mkl: list[ctypes.CDLL | None] = []  # resolved once: the library with MKL's service calls
_reserved: list[int] = []  # the process default before reserve(), per live reservation


def runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {
        line.split()[-1]
        for line in maps.splitlines()
        if any(n in line.rsplit("/", 1)[-1] for n in names)
    }


def gomp() -> ctypes.CDLL | None:
    """torch's libgomp when that is the process's only OpenMP runtime, else None."""
    with _lock:
        if not _gomp:
            found = runtimes()
            lib = None
            if len(found) == 1 and "libgomp" in next(iter(found)).rsplit("/", 1)[-1]:
                try:
                    lib = ctypes.CDLL(next(iter(found)))
                    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                    lib.omp_set_num_threads.restype = None
                except (OSError, AttributeError):
                    lib = None
            _gomp.append(lib)
        return _gomp[0]


def mkl() -> ctypes.CDLL | None:
    """The torch library that carries MKL (``mkl_set_num_threads_local_``), else None (a
    torch without MKL, or one whose MKL does not export it)."""
    with _lock:
        if not _mkl:
            lib = None
            if torch.backends.mkl.is_available():
                path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
                try:
                    lib = ctypes.CDLL(str(path))
                    setter = lib.mkl_set_num_threads_local_  # Fortran's: the count by reference
                    setter.argtypes = [ctypes.POINTER(ctypes.c_int)]
                    setter.restype = ctypes.c_int
                except (OSError, AttributeError):
                    lib = None
            _mkl.append(lib)
        return _mkl[0]


def cores() -> int:
    """CPUs this process may run on (its affinity mask, which is what libgomp counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def set_thread_count(n: int) -> None:
    """This thread's intra-op threads (OpenMP's and MKL's), leaving the process default
    (what other threads start from) as it is. torch's own per-thread start-up runs first,
    so it cannot reset the count at this thread's next parallel region."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    torch.get_num_threads()  # ATen's lazy per-thread init, done now
    lib = gomp()
    if lib is None:
        torch.set_num_threads(n)
        return
    lib.omp_set_num_threads(n)
    blas = mkl()
    if blas is not None:
        blas.mkl_set_num_threads_local_(ctypes.byref(ctypes.c_int(n)))


def default_threads() -> int:
    """The process's intra-op default as it was before any live ``reserve()``."""
    with _lock:
        return _reserved[0] if _reserved else torch.get_num_threads()


def reserve() -> Callable[[], None]:
    """Make 1 intra-op thread the default of this process's threads (engine workers set
    their own), and return the function that undoes it (the last one restores the default
    of before the first). Call on the thread that builds the engines, before loading."""
    with _lock:
        _reserved.append(_reserved[0] if _reserved else torch.get_num_threads())
        torch.set_num_threads(1)
    done = threading.Event()

    def release() -> None:
        if done.is_set():
            return
        done.set()
        with _lock:
            before = _reserved.pop()
            if not _reserved:
                torch.set_num_threads(before)

    return release


def wait_mode() -> str:
    value = os.environ.get(ENV_WAIT, "adaptive")
    if value not in WAIT_MODES:
        raise ValueError(f"{ENV_WAIT} must be one of {WAIT_MODES}, got {value!r}")
    return value


class Waiting:
    """How this process's OpenMP threads wait: ``sleeping`` while a keeper thread holds a
    team that makes libgomp throttle its spinning. One per process (``waiting()``)."""

    def __init__(self, team: int, fixed: bool = False) -> None:
        """``team``: the keeper's team size (the process's CPUs: with any engine team beside
        it the managed threads outnumber them); ``fixed``: reports and forgets change
        nothing (``KVFLOW_OMP_WAIT=sleep``)."""
        self._team = max(2, team)
        self._fixed = fixed
        self._lock = threading.Lock()
        self._keeper: threading.Thread | None = None
        self._release: threading.Event | None = None
        self._contended: dict[int, bool] = {}  # reporter id -> its last window's verdict
        self._generation = 0  # mode changes so far: a window spanning one is dropped
        self._sleep_windows = 0  # contended windows since the process last began sleeping
        self._probe_after = PROBE_AFTER
        self._probing = False  # spinning for one window to see whether the cores are free

    @property
    def generation(self) -> int:
        """Changes whenever the waits change mode (a reporter's window spanning a change
        measured both modes and is dropped)."""
        return self._generation

    @property
    def sleeping(self) -> bool:
        return self._keeper is not None

    def report(self, reporter: int, contended: bool) -> None:
        """One reporter's (an engine worker's) verdict on its last window; the process
        sleeps while any reporter's last verdict was contended."""
        if self._fixed:
            return
        with self._lock:
            self._contended[reporter] = contended
            want = any(self._contended.values())
            if self._keeper is None:  # spinning: a share measured so is the cores' true state
                probed, self._probing = self._probing, False
                if probed and not contended:
                    self._probe_after = PROBE_AFTER
                    logger.info("OpenMP waits: spinning (a probe found the engine's cores free)")
                elif probed:
                    self._probe_after = min(2 * self._probe_after, PROBE_MAX)
                if want:
                    self._sleep(logging.DEBUG if probed else logging.INFO)
            elif not want:
                self._spin()
            else:  # sleeping and contended, perhaps only by sleeping itself: probe now and then
                self._sleep_windows += 1
                if self._sleep_windows >= self._probe_after:
                    self._contended.clear()
                    self._probing = True
                    self._spin()

    def forget(self, reporter: int) -> None:
        """A reporter stopped (its worker ended): its verdict no longer counts."""
        if self._fixed:
            return
        with self._lock:
            self._contended.pop(reporter, None)
            if self._keeper is not None and not any(self._contended.values()):
                self._spin()

    def sleep(self) -> None:
        with self._lock:
            if self._keeper is None:
                self._sleep()

    def spin(self) -> None:
        with self._lock:
            if self._keeper is not None:
                self._spin()

    def _sleep(self, level: int = logging.INFO) -> None:
        ready, release = threading.Event(), threading.Event()
        team = self._team

        def keep() -> None:
            set_thread_count(team)
            torch.ones(team * 65536).add_(1)  # a parallel region of `team` threads
            ready.set()
            release.wait()

        keeper = threading.Thread(target=keep, name="omp-sleep-keeper", daemon=True)
        keeper.start()
        if not ready.wait(60.0):
            logger.warning("OpenMP waits: the keeper thread did not start its team in 60 s")
        self._keeper, self._release = keeper, release
        self._generation += 1
        self._sleep_windows = 0
        logger.log(level, "OpenMP waits: sleeping (the engine's cores are shared)")

    def _spin(self) -> None:
        assert self._keeper is not None and self._release is not None
        self._release.set()
        self._keeper.join(10.0)  # its team ends with it
        self._keeper = self._release = None
        self._generation += 1
        if self._probing:
            logger.debug("OpenMP waits: spinning for one window (a probe)")
        else:
            logger.info("OpenMP waits: spinning (the engine has its cores)")


_waiting: list[Waiting | None] = []


def waiting() -> Waiting | None:
    """The process's ``Waiting``, or None where it cannot act (not libgomp) or
    ``KVFLOW_OMP_WAIT=spin``. With ``sleep`` it starts sleeping and stays so."""
    with _lock:
        if _waiting:
            return _waiting[0]
    mode = wait_mode()
    made = None if mode == "spin" or gomp() is None else Waiting(cores(), mode == "sleep")
    with _lock:
        if not _waiting:
            _waiting.append(made)
        first = _waiting[0]
    if first is made and made is not None and mode == "sleep":
        made.sleep()  # outside _lock: the keeper's thread takes it (gomp())
    return first


class SpinControl:
    """An engine worker's side of ``Waiting``: feed each step's thread CPU and wall
    seconds; every ``WINDOW_S`` of step time the window's CPU share is reported."""

    def __init__(self, target: Waiting) -> None:
        self._target = target
        self._adaptive = wait_mode() == "adaptive"
        self._cpu = 0.0
        self._wall = 0.0
        self._generation = target.generation

    def step(self, cpu_s: float, wall_s: float) -> None:
        if not self._adaptive:
            return
        generation = self._target.generation
        if generation != self._generation:  # the mode changed within this window: drop it
            self._generation = generation
            self._cpu = self._wall = 0.0
            return
        self._cpu += cpu_s
        self._wall += wall_s
        if self._wall >= WINDOW_S:
            share = self._cpu / self._wall
            self._cpu = self._wall = 0.0
            self._target.report(id(self), share < BUSY_SHARE)
            self._generation = self._target.generation  # its own verdict's change: a new window

    def close(self) -> None:
        self._target.forget(id(self))
