"""A process that fails at once, for the supervisor tests:

    python -m tests.faults.fail_child COUNTER_FILE same|vary

prints one line on stderr and exits 3; with ``vary`` the line names the attempt (read from
and counted in COUNTER_FILE), so no two runs fail the same way."""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    counter, mode = Path(argv[0]), argv[1]
    attempt = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(attempt))
    detail = f" (attempt {attempt})" if mode == "vary" else ""
    print(f"fail_child: cannot start{detail}", file=sys.stderr, flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
