"""Run a command while busy processes keep every core busy: the suite as a loaded CI machine
runs it (`make test-loaded`; docs/testing.md).

    python -m tests.loaded [--busy N] -- COMMAND [ARGS...]

Starts ``N`` (default 2) child processes that spin at the same priority as the command, runs
the command, stops the children however it ends (a signal too; the kernel ends them if this
process dies, ``die_with_parent``) and exits with the command's status.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from types import FrameType

from kvflow.tools.supervise import die_with_parent

SPIN = "while True: pass"


def busy(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes spinning on one core each."""
    return [
        subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=die_with_parent) for _ in range(n)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.loaded", description=__doc__)
    p.add_argument("--busy", type=int, default=2, help="spinning processes (default 2)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if args.busy < 0:
        p.error(f"--busy: must be >= 0, got {args.busy}")

    def end(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, end)
    spinning = busy(args.busy)
    try:
        return subprocess.call(command)
    finally:
        stop(spinning)


if __name__ == "__main__":
    sys.exit(main())
