"""The certificates that keep a revision's swarm private (libtorrent's SSL torrents).

Each revision's torrent carries the root certificate of a certificate authority made for that
torrent alone (``SwarmAuthority``); libtorrent lets a peer in only over TLS with a certificate
that root signed. The upstream signs a node's certificate request only after the node's token
passed the model's read check, so a node that may not read a model never completes a handshake
with a peer of its swarm, and a certificate for one revision opens no other.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from functools import cache

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

# libtorrent accepts a peer whose certificate names the torrent or "*"; what admits it is the
# signature of the torrent's own authority.
PEER_NAME = "*"
# A node asks again (with the same key) long before this: every fill and every re-announce.
CERTIFICATE_DAYS = 7
_CLOCK_SKEW = datetime.timedelta(minutes=10)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@dataclass(frozen=True)
class SwarmAuthority:
    """One torrent's certificate authority: its key stays with the upstream."""

    key_pem: bytes
    certificate_pem: bytes

    @classmethod
    def create(cls, torrent_name: str) -> SwarmAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(f"weightserve swarm {torrent_name}"))
            .issuer_name(_name(f"weightserve swarm {torrent_name}"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            # The torrent (and its info-hash) lives as long as the revision: so does its root.
            .not_valid_after(now + datetime.timedelta(days=365 * 20))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
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
            )  # fmt: skip
            .sign(key, hashes.SHA256())
        )
        return cls(_pem_key(key), certificate.public_bytes(serialization.Encoding.PEM))

    def sign(self, request_pem: bytes, node: str) -> bytes:
        """A peer certificate for the key of ``request_pem`` (a PEM certificate request whose
        signature must hold); ValueError when it does not."""
        try:
            request = x509.load_pem_x509_csr(request_pem)
        except ValueError as e:
            raise ValueError(f"the certificate request is not a PEM CSR: {e}") from None
        if not request.is_signature_valid:
            raise ValueError("the certificate request's signature does not hold")
        authority_key = serialization.load_pem_private_key(self.key_pem, None)
        authority = x509.load_pem_x509_certificate(self.certificate_pem)
        now = datetime.datetime.now(datetime.timezone.utc)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(f"weightserve node {node}"[:64]))
            .issuer_name(authority.subject)
            .public_key(request.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(PEER_NAME)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(authority_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        return certificate.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class NodeKey:
    """A node's key for its swarms, and the request the upstream signs."""

    key_pem: bytes
    request_pem: bytes

    @classmethod
    def create(cls) -> NodeKey:
        key = ec.generate_private_key(ec.SECP256R1())
        request = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(_name("weightserve node"))
            .sign(key, hashes.SHA256())
        )
        return cls(_pem_key(key), request.public_bytes(serialization.Encoding.PEM))


# RFC 7919's ffdhe2048 group, from its definition (section A.1):
# p = 2^2048 - 2^1984 + (floor(2^1918 * e) + 560316) * 2^64 - 1, g = 2.
# libtorrent's TLS context refuses to start without DH parameters; generating fresh ones takes
# seconds, and a named group is what TLS recommends anyway.
_FFDHE2048_OFFSET = 560316


def _floor_e_times_2_pow(bits: int) -> int:
    """floor(e * 2^bits), exactly: the series sum(1/k!) in integers with 64 guard bits."""
    guard = 64
    scale = 1 << (bits + guard)
    total, term, k = 0, scale, 0
    while term:
        total += term
        k += 1
        term //= k
    # Each of the k truncations lost under one unit: far below the guard bits.
    return total >> guard


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def _der_integer(value: int) -> bytes:
    body = value.to_bytes(value.bit_length() // 8 + 1, "big")  # a leading 0: never negative
    return b"\x02" + _der_length(len(body)) + body


@cache
def dh_params_pem() -> str:
    """PKCS #3 ``DHParameter ::= SEQUENCE { prime INTEGER, base INTEGER }``, in PEM. Encoded
    here: cryptography's DH support warns that it is deprecated."""
    p = (1 << 2048) - (1 << 1984) + ((_floor_e_times_2_pow(1918) + _FFDHE2048_OFFSET) << 64) - 1
    body = _der_integer(p) + _der_integer(2)
    der = b"\x30" + _der_length(len(body)) + body
    text = base64.b64encode(der).decode()
    lines = [text[i : i + 64] for i in range(0, len(text), 64)]
    return "\n".join(["-----BEGIN DH PARAMETERS-----", *lines, "-----END DH PARAMETERS-----", ""])
