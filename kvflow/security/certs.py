"""Certificates for a local cluster: a self-signed CA and one server certificate it signs,
valid for ``127.0.0.1`` and ``localhost`` (``kvflow cluster --tls``, ``LocalCluster(tls=True)``).

Every process of a local cluster serves with the same server certificate and trusts the same
CA; a cluster across hosts brings its own certificates (``--tls-cert/--tls-key/--tls-ca``).
Keys are EC P-256 (fast to generate and to handshake), written with mode 0600; the
certificates are public (0644).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_DNS_NAMES = ("localhost",)
LOCAL_IPS = ("127.0.0.1",)
VALID_DAYS = 365


@dataclass(frozen=True)
class LocalCertFiles:
    """The paths ``generate_local_certs`` wrote (or found) in one directory."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvflow local cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a fresh ``path`` created with ``mode`` (no moment with a wider one)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _ca(now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("kvflow local CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
) -> x509.Certificate:
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in LOCAL_DNS_NAMES]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in LOCAL_IPS]
    return (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )


def generate_local_certs(
    directory: Path, *, now: datetime.datetime | None = None
) -> LocalCertFiles:
    """A new CA (``ca.pem``, ``ca.key``) and a server certificate (``server.pem``,
    ``server.key``) for 127.0.0.1/localhost signed by it, in ``directory`` (created 0700 when
    absent). Existing files of those names are replaced. Keys are written 0600."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = now or datetime.datetime.now(datetime.UTC)
    ca_key, ca_cert = _ca(now)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _server_cert(ca_key, ca_cert, key, now)
    files = LocalCertFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    _write(directory / "ca.key", _key_pem(ca_key), 0o600)
    _write(files.key_file, _key_pem(key), 0o600)
    _write(files.ca_file, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(files.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return files


def local_certs(directory: Path) -> LocalCertFiles:
    """The local cluster's certificates in ``directory``, generated when any is missing or the
    server certificate expires within a day (a restarted cluster keeps its CA otherwise)."""
    files = LocalCertFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    if all(p.exists() for p in (files.ca_file, files.cert_file, files.key_file)):
        cert = x509.load_pem_x509_certificate(files.cert_file.read_bytes())
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
        if cert.not_valid_after_utc > soon:
            return files
    return generate_local_certs(directory)
