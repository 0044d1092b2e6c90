"""The local cluster's certificates (``security.certs``) and the TLS settings' input checks
(``security.tls.TlsSettings``): files, modes, names, and errors that name the file."""

from __future__ import annotations

import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from kvflow.security.certs import generate_local_certs, local_certs
from kvflow.security.tls import TlsSettings, process_tls, read_pem


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_and_modes(tmp_path: Path) -> None:
    files = generate_local_certs(tmp_path / "tls")
    assert mode(tmp_path / "tls") == 0o700
    assert mode(files.key_file) == 0o600
    assert mode(tmp_path / "tls" / "ca.key") == 0o600
    assert mode(files.cert_file) == 0o644
    assert mode(files.ca_file) == 0o644
    TlsSettings(files.cert_file, files.key_file, files.ca_file).check()


def test_server_certificate_names_and_issuer(tmp_path: Path) -> None:
    files = generate_local_certs(tmp_path)
    cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca_file.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert cert.issuer == ca.subject
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca)  # raises when the CA did not sign it
    public = ca.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    assert cert.not_valid_after_utc > datetime.datetime.now(datetime.UTC) + datetime.timedelta(
        days=300
    )


def test_local_certs_are_kept_across_restarts_and_renewed_near_expiry(tmp_path: Path) -> None:
    first = local_certs(tmp_path)
    ca = first.ca_file.read_bytes()
    assert local_certs(tmp_path) == first and first.ca_file.read_bytes() == ca
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=364, hours=12)
    generate_local_certs(tmp_path, now=old)  # expires within a day
    stale = first.ca_file.read_bytes()
    local_certs(tmp_path)
    assert first.ca_file.read_bytes() != stale


def test_certificate_without_key_is_refused() -> None:
    with pytest.raises(ValueError, match="--tls-cert, --tls-key"):
        TlsSettings(cert_file=Path("server.pem"))


def test_missing_and_non_pem_files_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError, match=f"{missing}: cannot read the TLS CA file"):
        TlsSettings(ca_file=missing).check()
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match=f"{junk}: the TLS certificate file is not PEM"):
        read_pem(junk, "certificate")


def test_process_settings_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = generate_local_certs(tmp_path)
    settings = TlsSettings(files.cert_file, files.key_file, files.ca_file)
    for name in ("KVFLOW_TLS_CERT_FILE", "KVFLOW_TLS_KEY_FILE", "KVFLOW_TLS_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert process_tls() == TlsSettings()
    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)
    assert process_tls() == settings
    assert process_tls().serves_tls and process_tls().connects_tls
