"""SGLang's `bench_serving`, as docs/sglang.md runs it: the page's `kvflow serve` block (the
embedded server on the default model, in a folder of the test's, on free ports) and then its
`bench_serving` block, exactly, from `.venv-sglang` (`make sglang-tools` builds it; opt-in, so
the test skips where it was not built). Every request must complete without an error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from tests.conftest import pick_free_port
from tests.docs.blocks import ROOT
from tests.docs.shell import adapt, run_bash
from tests.integrations.sglang_docs import doc_block

SGLANG_VENV = ROOT / ".venv-sglang"
READY_LINE = "kvflow serving"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (SGLANG_VENV / ".installed").is_file(),
        reason=".venv-sglang is not built (opt-in: `make sglang-tools`, about 6 GB; "
        "docs/sglang.md, bench_serving)",
    ),
]


class Serve:
    """The page's `kvflow serve` block in a process group of its own, its output collected."""

    def __init__(self, text: str, cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
        self.proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", text],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith(READY_LINE):
                self.ready.set()
        self.ready.set()  # ended: the waiter sees the exit code

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.mark.timeout(900)
def test_documented_bench_serving_completes_every_request(tmp_path: Path) -> None:
    serve_block = doc_block("sglang.md", "sglang-bench-serve").strip()
    bench_block = doc_block("sglang.md", "sglang-bench-serving")
    assert serve_block == ".venv/bin/kvflow serve"
    assert "--tokenizer data/models/SmolLM2-135M-Instruct" in bench_block
    match = re.search(r"--num-prompts (\d+)", bench_block)
    assert match is not None
    prompts = int(match.group(1))

    http = f"127.0.0.1:{pick_free_port()}"
    # The block as written, on free ports instead of the defaults (gRPC 50051, HTTP 8000,
    # metrics 9464) so it runs beside anything else on the machine.
    server = Serve(
        adapt(serve_block)
        + f" --port {pick_free_port()} --http-port {http.split(':')[1]} --metrics-port 0",
        tmp_path,
    )
    try:
        assert server.ready.wait(600) and server.proc.poll() is None, "\n".join(server.lines)
        assert (tmp_path / "data/models/SmolLM2-135M-Instruct/tokenizer.json").is_file()
        out = run_bash(
            bench_block.replace(".venv-sglang/bin/", f"{SGLANG_VENV}/bin/"),
            tmp_path,
            http=http,
            timeout=600,
        )
    finally:
        server.stop()
    print(out.stdout[out.stdout.index("=" * 10) :])  # the summary, in the test's log
    assert re.search(rf"^Successful requests:\s+{prompts}\s*$", out.stdout, re.M), out.stdout
    results = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert len(results) == 1
    result = results[0]
    assert result["completed"] == prompts  # a failed request is not counted
    assert result["total_output_tokens"] > 0 and result["server_info"]["version"].startswith(
        "kvflow"
    )
