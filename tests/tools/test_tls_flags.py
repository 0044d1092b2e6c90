"""The TLS flags' errors name the file, before any server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.tools import cli


def test_serve_refuses_a_missing_certificate_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    argv = ["serve", "--role", "meta", "--tls-cert", str(cert), "--tls-key", str(key)]
    assert cli.main(argv) == 2
    assert f"{cert}: cannot read the TLS certificate file" in capsys.readouterr().out


def test_serve_refuses_a_certificate_without_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--role", "meta", "--tls-cert", str(tmp_path / "c.pem")]) == 2
    assert "--tls-cert, --tls-key" in capsys.readouterr().out


def test_generate_refuses_a_ca_that_is_not_pem(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("hello")
    with pytest.raises(SystemExit, match=f"{ca}: the TLS CA file is not PEM"):
        cli.main(["generate", "--prompt", "x", "--tls-ca", str(ca)])
