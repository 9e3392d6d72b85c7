"""Who may join a TLS group: every holder of a group's secret, and nobody else.

From the secret (and an optional salt, a fleet's session) every member derives the same
certificate authority key, deterministically — HKDF-SHA256 (RFC 5869) to 48 bytes, reduced to a
P-256 scalar (FIPS 186-4 B.4.1, "extra random bits") — builds the same CA name from it, and
signs a fresh leaf key of its own with it. Peers present their leaf and trust only that CA, in
both directions (``CERT_REQUIRED`` on the accepting side too): a TLS 1.3 handshake (RFC 8446)
with someone who lacks the secret fails, and every byte after it is encrypted and
authenticated (AES-GCM or ChaCha20-Poly1305 records). Leaf keys never leave the process; the
CA key is never written anywhere.
"""
from __future__ import annotations

import datetime
import os
import ssl
import tempfile

CURVE_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551   # P-256 n
#: how far a peer's clock may be off and its leaf still be valid
CLOCK_SKEW = datetime.timedelta(days=1)


def _ca_key(secret: bytes, salt: bytes):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    raw = HKDF(hashes.SHA256(), 48, salt=salt or None,
               info=b"lowcomm tls group ca").derive(secret)
    return ec.derive_private_key(int.from_bytes(raw, "big") % (CURVE_ORDER - 1) + 1,
                                 ec.SECP256R1())


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lowcomm"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, issuer: str, key, signer, ca: bool):
    """A certificate of ``key``'s public half, signed by ``signer``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    now = datetime.datetime.now(datetime.timezone.utc)
    pub, signer_pub = key.public_key(), signer.public_key()
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(pub).serial_number(x509.random_serial_number())
         .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + 365 * CLOCK_SKEW)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(pub), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_pub),
                        critical=False))
    if ca:
        b = b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                          False), critical=True)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                   ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False)
    return b.sign(signer, hashes.SHA256())


def contexts(secret: bytes, salt: bytes = b"") -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the accepting side's, the connecting side's) TLS 1.3 contexts of the group that
    ``secret`` (salted by ``salt``) admits (module docstring)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    ca_key = _ca_key(secret, salt)
    tag = ca_key.public_key().public_bytes(serialization.Encoding.X962,
                                           serialization.PublicFormat.CompressedPoint)
    h = hashes.Hash(hashes.SHA256())
    h.update(tag)
    ca_name = f"lowcomm group CA {h.finalize().hex()[:16]}"
    ca = _cert(ca_name, ca_name, ca_key, ca_key, True)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = _cert("lowcomm group member", ca_name, leaf_key, ca_key, False)
    pem = serialization.Encoding.PEM
    key_pem = leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
    out = []
    for side in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(side)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False          # a member is whoever holds the secret, not a name
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=ca.public_bytes(pem).decode())
        _load_leaf(ctx, leaf.public_bytes(pem) + key_pem)
        out.append(ctx)
    out[0].num_tickets = 0                  # no resumption: nothing is written after a handshake
    return out[0], out[1]


def _load_leaf(ctx: ssl.SSLContext, pem: bytes) -> None:
    """``ssl`` loads a key from a file only: one readable by this user alone, removed at once."""
    with tempfile.TemporaryDirectory(prefix="lowcomm-tls-") as d:
        path = os.path.join(d, "leaf.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        ctx.load_cert_chain(path)


__all__ = ["contexts"]
