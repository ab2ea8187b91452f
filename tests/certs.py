"""Throwaway certificate authorities and certificates for TLS tests (needs `cryptography`).

    ca = make_ca(tmp_path)                                  # ca.cert: the PEM a client trusts
    server = make_cert(ca, tmp_path, "control")             # 127.0.0.1 and localhost
    client = make_cert(ca, tmp_path, "worker-1", client=True)
    other = make_ca(tmp_path, "other-ca")                   # unrelated: its certificates must fail

Keys are EC P-256 (fast to make); certificates are valid from an hour ago for a day. Every file is
PEM, named after its subject, under the directory given.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CA:
    """A certificate authority: `cert` and `key` are PEM files; the objects sign what make_cert makes."""

    name: str
    cert: Path
    key: Path
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Issued:
    """A leaf certificate and its key (PEM files), and the chain a peer needs to trust it."""

    cert: Path
    key: Path
    ca_cert: Path

    def key_and_chain(self) -> tuple[bytes, bytes]:
        """(private key, certificate) PEM bytes, the pair grpc.ssl_server_credentials() takes."""
        return self.key.read_bytes(), self.cert.read_bytes()


def make_ca(directory: Path, name: str = "stepwise-test-ca") -> CA:
    """A self-signed CA named `name`, written to DIRECTORY/NAME.crt and NAME.key.

    Two calls with different names give two unrelated CAs (for a peer that must be rejected).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(name)
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = _write(directory, name, cert, key)
    return CA(name, cert_path, key_path, cert, key)


def make_cert(
    ca: CA,
    directory: Path,
    name: str,
    ip: str | None = "127.0.0.1",
    dns: tuple[str, ...] = ("localhost",),
    client: bool = False,
    server_and_client: bool = False,
) -> Issued:
    """A certificate for `name` signed by `ca`, written to DIRECTORY/NAME.crt and NAME.key.

    Subject alternative names: the IP `ip` (None: none) and the DNS names `dns`, plus `name` itself
    for a client. Extended key usage: serverAuth, or clientAuth when `client` is true, or both with
    `server_and_client` (a control plane that also asks its peers over mutual TLS).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    if client and name not in dns:
        sans.append(x509.DNSName(name))
    if ip is not None:
        sans.append(x509.IPAddress(ipaddress.ip_address(ip)))
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
    if server_and_client:
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        _builder(_name(name), ca.certificate.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert_path, key_path = _write(directory, name, builder.sign(ca.private_key, hashes.SHA256()), key)
    return Issued(cert_path, key_path, ca.cert)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _key_usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _write(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key_path.write_bytes(key_bytes)
    key_path.chmod(0o600)
    return cert_path, key_path
