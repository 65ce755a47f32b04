"""Self-signed certificates for TLS endpoints on loopback (RGW's beast frontend and
:class:`~objckpt.testing.FaultProxy` with ``tls=``).

Why one helper: a custom CA bundle (``client_kwargs={"verify": path}``, or
``AWS_CA_BUNDLE``) is a store option objckpt must honour in every client it builds,
and proving it needs an endpoint whose certificate no system store trusts. The
certificate is its own CA (``BasicConstraints(ca=True)``), valid for ``127.0.0.1``
and ``localhost``; ``cryptography`` (a dependency of moto) makes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

__all__ = ["TestCertificate", "make_certificate"]


@dataclasses.dataclass(frozen=True)
class TestCertificate:
    """Where a self-signed certificate lies.

    Attributes:
        cert_file: The certificate followed by its private key (what a server loads).
        ca_file: The certificate alone (what a client verifies with).
    """

    __test__ = False  # not a pytest test class

    cert_file: Path
    ca_file: Path


def make_certificate(
    cert_file: Path, ca_file: Path, *, name: str = "objckpt test endpoint"
) -> TestCertificate:
    """Write a new self-signed certificate for ``127.0.0.1`` and ``localhost``.

    Raises:
        ImportError: ``cryptography`` is not installed.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    cert_file.write_bytes(cert_pem + key_pem)
    ca_file.write_bytes(cert_pem)
    return TestCertificate(cert_file=cert_file, ca_file=ca_file)
