"""Ctrl-C during `kvflow serve` start-up stops it promptly, and stops what already started.

asyncio.run's SIGINT handler only cancels the main task at its next await, so a Ctrl-C while
a model loaded synchronously used to wait for start-up to end (4-7 s measured), then exit
without stopping what it started ("coroutine 'AioServer.shutdown' was never awaited", once a
SIGSEGV)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvflow.stages.engine import write_demo_model
from kvflow.tools.serve import _interruptible_startup, _stop_on_signal, _until_signal


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_right_after_startup_stops_serving_cleanly(sig: signal.Signals) -> None:
    """The stop handler is in place the moment start-up ends, before the role says it serves:
    a signal sent on that line sets the stop event instead of meeting the default action
    (SIGTERM killed the server, exit -15, in a loaded test run)."""

    async def serve() -> bool:
        with _interruptible_startup():
            pass
        stop = _stop_on_signal()
        os.kill(os.getpid(), sig)  # at once, as a supervisor reading the serving line would
        await asyncio.wait_for(_until_signal(stop), timeout=30)
        return stop.is_set()

    assert asyncio.run(serve())


def _signal_soon(sig: signal.Signals, after_s: float = 0.2) -> threading.Timer:
    timer = threading.Timer(after_s, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_interrupts_synchronous_startup_at_once(sig: signal.Signals) -> None:
    async def startup() -> None:
        with _interruptible_startup():
            time.sleep(10)  # a model loading on the event loop's thread

    _signal_soon(sig)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match=sig.name):
        asyncio.run(startup())
    assert time.monotonic() - started < 2.0
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers given back


def test_an_interrupt_native_code_turned_into_its_own_error_stays_an_interrupt() -> None:
    def native_load() -> None:
        try:
            time.sleep(10)
        except KeyboardInterrupt:  # what safetensors' load_file does
            raise ValueError("could not determine the shape of object") from None

    _signal_soon(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), _interruptible_startup():
        native_load()
    with pytest.raises(ValueError), _interruptible_startup():  # no signal: the error itself
        raise ValueError("a real start-up error")


def test_ctrl_c_during_serve_startup(tmp_path: Path) -> None:
    model = write_demo_model(tmp_path / "tiny", preset="tiny", seed=0)
    cmd = [sys.executable, "-m", "kvflow.tools.cli", "serve", "--model", str(model)]
    cmd += ["--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0"]
    cmd += ["--metrics-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the metadata group is up; the engines load next
            if "metadata replica started" in line:
                break
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        rest = proc.stdout.read()
        assert proc.wait(30) == 130, rest
        assert time.monotonic() - started < 10.0
        assert "never awaited" not in rest and "kvflow serving" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
