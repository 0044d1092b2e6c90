"""The authentication benchmark's arithmetic (paired differences, not differences of p50s)
and its TLS socket measurement on real loopback sockets (small, fast)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.security.certs import generate_local_certs
from kvflow.tools.bench.auth import summarize_ttft
from kvflow.tools.bench.auth_transfer import bench_tls_socket, paired_change


def test_paired_difference_is_the_median_of_same_round_differences() -> None:
    # the p50s differ by 10 ms; round by round, secret is 1 ms slower twice out of three
    ttfts = {"open": [10.0, 20.0, 40.0], "secret": [11.0, 41.0, 30.0]}
    out = summarize_ttft(ttfts)
    assert out["open_ttft_p50_ms"] == 20.0 and out["secret_ttft_p50_ms"] == 30.0
    assert out["secret_paired_diff_ms"] == 1.0  # median of (1, 21, -10)
    assert out["secret_paired_change"] == pytest.approx(0.05)
    assert paired_change({"a": [2.0, 4.0, 9.0], "b": [1.0, 4.0, 10.0]}, "a", "b") == 0.0


def test_tls_socket_reads_over_both_connections(tmp_path: Path) -> None:
    certs = generate_local_certs(tmp_path)
    out = bench_tls_socket(certs.cert_file, certs.key_file, certs.ca_file, repeats=2, reads=2)
    assert len(out["runs_gbps"]["tls"]) == len(out["runs_gbps"]["plain"]) == 2
    assert out["tls_gbps"] > 0 and out["plain_gbps"] > 0
    assert out["cipher"].startswith("TLS_")
