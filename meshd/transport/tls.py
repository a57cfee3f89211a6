"""TLS certificates that carry a node's identity.

Each node presents a self-signed X.509 certificate whose subject public key is
its Ed25519 identity key.  TLS 1.3's CertificateVerify then proves, inside
this very handshake, that the sender holds that key, so the PeerId read off
the peer's certificate is authenticated and bound to the connection.  Both
sides present one (the server asks the client for it).  No CA is involved:
trust comes from the PeerId the dialer asked for.
"""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from ..identity import Identity, PeerId


class PeerAuthError(Exception):
    """The peer did not prove the identity it had to."""


def identity_certificate(identity: Identity) -> x509.Certificate:
    """A self-signed certificate for ``identity``'s key (valid for 10 years)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(identity.peer_id))])
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(identity.private_key, None)
    )


def peer_id_from_certificate(cert: x509.Certificate | None) -> PeerId:
    """The PeerId a handshake proved, or PeerAuthError if there is none."""
    if cert is None:
        raise PeerAuthError("peer presented no certificate")
    key = cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise PeerAuthError(f"peer certificate holds a {type(key).__name__}, not Ed25519")
    return PeerId.from_public_key(key)
