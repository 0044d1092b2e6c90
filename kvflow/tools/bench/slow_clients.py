"""Slow-header clients against the embedded server's HTTP front: N connections each send a
request line and one header, then nothing. Measures how many the server closes, and how
soon, while a normal request is answered meanwhile (``--http-header-timeout-s``).

Prints one summary line; ``--json PATH`` writes the numbers.

    python -m kvflow.tools.bench.slow_clients --connections 2000
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from kvflow.stages.engine import write_demo_model
from kvflow.stages.serve.background import BackgroundServer
from kvflow.stages.serve.config import HttpConfig, ServeConfig


def measure(port: int, model: str, connections: int, wait_s: float) -> dict[str, Any]:
    socks = []
    start = time.monotonic()
    for _ in range(connections):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # the headers never end
        socks.append(s)
    opened_s = time.monotonic() - start
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    sent = time.monotonic()
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    answered_ms = (time.monotonic() - sent) * 1000
    conn.close()
    closed, last = 0, 0.0
    deadline = time.monotonic() + wait_s
    for s in socks:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if s.recv(16) == b"":
                closed += 1
                last = time.monotonic() - start
        except OSError:
            pass
        s.close()
    return {
        "connections": connections,
        "opened_s": opened_s,
        "normal_status": resp.status,
        "normal_ms": answered_ms,
        "closed": closed,
        "all_closed_after_s": last,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--header-timeout-s", type=float, default=10.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        config = ServeConfig(
            model_dir=model,
            data_dir=Path(tmp) / "data",
            block_size=16,
            num_pages=256,
            staging_pages=256,
            storage_engine="memory",
        )
        http = HttpConfig(port=0, header_timeout_s=args.header_timeout_s)
        server = BackgroundServer(config, http=http)
        try:
            assert server.http is not None
            doc = measure(server.http.port, "tiny", args.connections, args.header_timeout_s + 20)
        finally:
            server.close()
    doc["header_timeout_s"] = args.header_timeout_s
    doc["load_avg"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    print(
        f"bench slow_clients: {doc['closed']}/{doc['connections']} slow-header connections "
        f"closed by the server, the last {doc['all_closed_after_s']:.1f} s after the first "
        f"opened (header timeout {args.header_timeout_s:g} s); a normal request meanwhile: "
        f"HTTP {doc['normal_status']} in {doc['normal_ms']:.0f} ms; "
        f"load avg {doc['load_avg'][0]:.2f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
