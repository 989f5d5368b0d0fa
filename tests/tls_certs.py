"""Throwaway PKI for the mutual-TLS tests, made with ``cryptography`` at test time.

    pki = make_pki(tmp_path)   # pki.ca, pki.server, pki.client, pki.rogue: PemPair paths

``server`` and ``client`` are signed by ``ca`` for 127.0.0.1 / localhost and allow both TLS
uses (pdserve processes use one certificate as server and client); ``rogue`` is the same kind
of certificate signed by another CA, so a server must refuse it. EC P-256, valid one day.
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
class PemPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path  # the CA certificate every pdserve process trusts
    server: PemPair
    client: PemPair
    rogue: PemPair  # signed by a CA nobody trusts


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
           issuer_key: ec.EllipticCurvePrivateKey, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([
                       x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, stem: str, cert: x509.Certificate,
           key: ec.EllipticCurvePrivateKey) -> PemPair:
    pair = PemPair(directory / f"{stem}.crt", directory / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return pair


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    pairs = {}
    for ca_name in ("ca", "rogue-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _issue(f"pdserve test {ca_name}", ca_key, _name(f"pdserve test {ca_name}"), ca_key, True)
        pairs[ca_name] = _write(directory, ca_name, ca_cert, ca_key)
        for leaf in (("server", "client") if ca_name == "ca" else ("rogue",)):
            key = ec.generate_private_key(ec.SECP256R1())
            pairs[leaf] = _write(directory, leaf, _issue(leaf, key, ca_cert.subject, ca_key, False), key)
    return Pki(pairs["ca"].cert, pairs["server"], pairs["client"], pairs["rogue"])
