"""Node identity: an Ed25519 key pair kept in the data directory, and PeerIds.

A PeerId is the node's raw 32-byte Ed25519 public key.  Its text form is the
key followed by a 3-byte checksum, in lowercase RFC 4648 base32 without padding:
56 characters, so a mistyped or truncated id is caught before it is dialed.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from dht.records import signed_by  # the one Ed25519 check of peers' signatures (libsodium, docs/libraries.md)

KEY_FILE = "identity.key"
_CHECKSUM_LEN = 3
_TEXT_LEN = 56  # base32 of 32 + 3 bytes, exactly, with no padding
_ALPHABET = set("abcdefghijklmnopqrstuvwxyz234567")


class IdentityError(Exception):
    """The identity key file is missing, unsafe or unreadable."""


class PeerIdError(ValueError):
    """Text that was meant to be a PeerId is not one; the message says why."""


def _checksum(key: bytes) -> bytes:
    return hashlib.sha256(b"meshd-peer-id" + key).digest()[:_CHECKSUM_LEN]


@functools.lru_cache(maxsize=4096)
def _text_of(key: bytes) -> str:
    """The text form of ``key`` (a node meets few peers, and names each of them often:
    every change a watcher is told of names its author)."""
    return base64.b32encode(key + _checksum(key)).decode().lower()


class PeerId:
    """The public identity of a node: 32 raw Ed25519 public-key bytes.

    Equal keys give equal, hashable PeerIds; ``str()`` gives the checksummed
    text form and :meth:`from_string` parses it back.
    """

    __slots__ = ("key",)

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or len(key) != 32:
            raise PeerIdError("a PeerId is 32 bytes of Ed25519 public key")
        self.key = key

    @classmethod
    def from_string(cls, text: str) -> "PeerId":
        """Parse the 56-character text form, checking alphabet, length and checksum."""
        text = text.strip()
        if len(text) != _TEXT_LEN:
            raise PeerIdError(
                f"a PeerId has {_TEXT_LEN} characters, {text[:12]!r}... has {len(text)}"
            )
        bad = sorted(set(text) - _ALPHABET)
        if bad:
            raise PeerIdError(
                f"a PeerId uses only a-z and 2-7; found {''.join(bad)!r}"
            )
        raw = base64.b32decode(text.upper())
        key, check = raw[:32], raw[32:]
        if _checksum(key) != check:
            raise PeerIdError(f"PeerId {text[:12]}... fails its checksum (mistyped?)")
        return cls(key)

    @classmethod
    def from_public_key(cls, public_key: Ed25519PublicKey) -> "PeerId":
        return cls(public_key.public_bytes_raw())

    def public_key(self) -> Ed25519PublicKey:
        return Ed25519PublicKey.from_public_bytes(self.key)

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True when ``signature`` is this peer's Ed25519 signature of ``data``."""
        return signed_by(self.key, signature, data)

    def short(self) -> str:
        """The first 10 characters, for logs and tables."""
        return _text_of(self.key)[:10]

    def __str__(self) -> str:
        return _text_of(self.key)

    def __repr__(self) -> str:
        return f"PeerId({self.short()}...)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerId) and other.key == self.key

    def __lt__(self, other: "PeerId") -> bool:
        return self.key < other.key

    def __hash__(self) -> int:
        return hash(self.key)


class Identity:
    """A node's private key and the PeerId that goes with it."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self.private_key = private_key
        self.peer_id = PeerId.from_public_key(private_key.public_key())

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def create_identity(data_dir: Path) -> Identity:
    """Generate a key and write it to ``data_dir/identity.key`` with mode 0600.

    Fails with IdentityError if the file already exists, so a key is never
    overwritten.
    """
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = data_dir / KEY_FILE
    identity = Identity.generate()
    pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise IdentityError(f"{path} already exists; refusing to overwrite a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    return identity


_DAMAGED_KEY_FIX = "restore the key from a backup, or move it aside to start as a new identity (a new peer id)"


def load_identity(data_dir: Path) -> Identity:
    """Read ``data_dir/identity.key``, refusing a key that others can read.

    Each IdentityError says what is wrong with the file and what to do about it."""
    path = data_dir / KEY_FILE
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise IdentityError(f"no identity key at {path}; run `meshd init`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"{path} is readable by other users (mode {stat.S_IMODE(mode):04o}); "
            f"run `chmod 600 {path}`"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except ValueError:  # cryptography's words point at its FAQ, not at what to do
        raise IdentityError(f"{path} is not a PEM private key (damaged?); {_DAMAGED_KEY_FIX}") from None
    except TypeError:  # a key sealed with a password: the daemon starts unattended and has none
        raise IdentityError(f"{path} is encrypted with a password; meshd needs it unencrypted "
                            "(decrypt it with openssl pkey), or move it aside to start as a new identity") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key; {_DAMAGED_KEY_FIX}")
    return Identity(key)


def load_or_create_identity(data_dir: Path) -> Identity:
    """The identity in ``data_dir``, created on first use."""
    if (data_dir / KEY_FILE).exists():
        return load_identity(data_dir)
    return create_identity(data_dir)
