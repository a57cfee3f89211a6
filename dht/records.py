"""Signed DHT records and the namespaced validators that admit them.

A record is a value stored under a key, signed by its author's Ed25519 key.
Keys are namespaced, ``b"/<namespace>/<rest>"``, and each namespace has a
validator (:mod:`dht.validators`) that decides which records it admits and
which of two records for the same key wins.  Three namespaces are built in:

- ``/open/``: any author may write any key;
- ``/owned/<author public key hex>/<name>``: only that author may write;
- ``/name/<name>``: the first to claim it, and the writers it allows
  (:mod:`dht.names`).

The library never holds private keys: signing goes through a caller-supplied
``sign(data) -> signature`` function.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import msgpack
from nacl.bindings import crypto_sign_open
from nacl.exceptions import CryptoError

from .ids import PUBLIC_KEY_SIZE

MAX_KEY = 256  # bytes
MAX_VALUE = 16 * 1024  # bytes
MAX_TTL = 48 * 3600  # seconds a record may live
CLOCK_SKEW = 60  # seconds of clock difference tolerated on expiry times
SIGNATURE_SIZE = 64
MAX_INT = 2**63  # seq and expires lie in [0, MAX_INT)
RECORD_OVERHEAD = PUBLIC_KEY_SIZE + SIGNATURE_SIZE + 16  # approx. bytes besides key and value

_SIGNING_CONTEXT = b"meshd-dht-record/1"
_WIRE_FIELDS = {"k": "key", "v": "value", "pk": "public_key", "seq": "seq", "exp": "expires", "sig": "signature"}
_OWNED_PREFIX = b"/owned/"


class RecordError(ValueError):
    """A record is malformed, forged, expired, too large, or not allowed in its
    namespace; the message says which."""


def _check_bytes(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, bytes) or not low <= len(value) <= high:
        size = str(low) if low == high else f"{low}-{high}"
        raise RecordError(f"a record's {name} must be {size} bytes")


def _check_int(name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value < MAX_INT:
        raise RecordError(f"a record's {name} must be an integer in [0, 2**63)")


@dataclass(frozen=True)
class Record:
    """A signed value under a key.

    Construction checks every field's type and size (raising RecordError), so
    a Record is always well-formed; whether its signature verifies, whether it
    is fresh, and whether its namespace admits it is for a validator to say.
    """

    key: bytes
    value: bytes
    public_key: bytes  # the author
    seq: int
    expires: int  # unix seconds
    signature: bytes

    def __post_init__(self) -> None:
        _check_bytes("key", self.key, 1, MAX_KEY)
        _check_bytes("value", self.value, 0, MAX_VALUE)
        _check_bytes("public key", self.public_key, PUBLIC_KEY_SIZE, PUBLIC_KEY_SIZE)
        _check_int("seq", self.seq)
        _check_int("expiry time", self.expires)
        _check_bytes("signature", self.signature, SIGNATURE_SIZE, SIGNATURE_SIZE)

    def signed_bytes(self) -> bytes:
        """The bytes the signature covers: everything but the author, who is
        bound by the key that verifies it."""
        return msgpack.packb([_SIGNING_CONTEXT, self.key, self.value, self.seq, self.expires])

    def verify_signature(self) -> bool:
        """Whether ``signature`` is the author's signature of ``signed_bytes()``."""
        return signed_by(self.public_key, self.signature, self.signed_bytes())

    @property
    def encoded_size(self) -> int:
        """Approximate bytes the record takes, for storage accounting."""
        return len(self.key) + len(self.value) + RECORD_OVERHEAD

    def to_wire(self) -> dict:
        """The msgpack-ready map ``{"k", "v", "pk", "seq", "exp", "sig"}``."""
        return {wire: getattr(self, name) for wire, name in _WIRE_FIELDS.items()}

    @classmethod
    def from_wire(cls, obj: object) -> Record:
        """Parse a map made by ``to_wire``, checking every field's type and
        size; unknown fields are ignored.  Raises RecordError when malformed.
        Does not verify the signature."""
        if not isinstance(obj, dict):
            raise RecordError("a record must be a map")
        missing = [wire for wire in _WIRE_FIELDS if wire not in obj]
        if missing:
            raise RecordError(f"a record is missing fields: {', '.join(missing)}")
        return cls(**{name: obj[wire] for wire, name in _WIRE_FIELDS.items()})


def sign_record(
    key: bytes, value: bytes, *, public_key: bytes, sign: Callable[[bytes], bytes], seq: int, expires: int
) -> Record:
    """A record of ``value`` under ``key`` signed with ``sign``, which must be
    the signing function of ``public_key``.  Raises RecordError when a field
    is malformed or ``sign`` returns something that is not a signature."""
    unsigned = Record(key, value, public_key, seq, expires, bytes(SIGNATURE_SIZE))
    return dataclasses.replace(unsigned, signature=sign(unsigned.signed_bytes()))


def namespace_of(key: bytes) -> bytes:
    """The namespace of ``b"/<namespace>/<rest>"``, e.g. ``b"open"``; raises
    RecordError when the key does not have that shape."""
    namespace, slash, rest = key[1:].partition(b"/")
    if not key.startswith(b"/") or not namespace or not slash or not rest:
        raise RecordError("key must look like /namespace/name")
    return namespace


def owned_key(public_key: bytes, name: bytes) -> bytes:
    """The ``/owned/`` key only the holder of ``public_key`` may write."""
    _check_bytes("public key", public_key, PUBLIC_KEY_SIZE, PUBLIC_KEY_SIZE)
    if not name:
        raise RecordError("an /owned/ key needs a non-empty name")
    return _OWNED_PREFIX + public_key.hex().encode() + b"/" + name


class OpenValidator:
    """``/open/``: any author may write.  A record must be signed by its
    author, unexpired, and expire no later than MAX_TTL (+ CLOCK_SKEW) from now.
    The better record has the higher seq, then the later expiry, then the
    larger signature bytes (an arbitrary but deterministic tie-break)."""

    def validate(self, record: Record, now: float) -> None:
        if record.expires <= now:
            raise RecordError(f"record expired at {record.expires}")
        if record.expires > now + MAX_TTL + CLOCK_SKEW:
            raise RecordError(f"record expires more than {MAX_TTL} s from now")
        if not record.verify_signature():
            raise RecordError("record signature does not verify with its public key")

    def better(self, a: Record, b: Record) -> bool:
        return (a.seq, a.expires, a.signature) > (b.seq, b.expires, b.signature)


class OwnedValidator(OpenValidator):
    """``/owned/<public key hex>/<name>``: as ``/open/``, and the record's
    author must be the key named in its key (lower-case hex)."""

    def validate(self, record: Record, now: float) -> None:
        owner, slash, name = record.key.removeprefix(_OWNED_PREFIX).partition(b"/")
        if not record.key.startswith(_OWNED_PREFIX) or not slash or not name:
            raise RecordError("an /owned/ key must look like /owned/<public key hex>/<name>")
        if owner != record.public_key.hex().encode():
            raise RecordError("only the public key named in an /owned/ key may write it")
        super().validate(record, now)


def signed_by(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is the Ed25519 signature of ``data`` by ``public_key``.

    libsodium (PyNaCl) verifies in about half the time OpenSSL takes (72
    against 159 µs on the 2-core VM), and every replica checks every record.
    meshd checks its peers' other signatures with this function too
    (``PeerId.verify``, shard manifests): a library cannot import meshd.
    """
    if len(signature) != SIGNATURE_SIZE:  # libsodium takes signature and data as one string
        return False
    try:
        crypto_sign_open(signature + data, public_key)
    except CryptoError:
        return False
    return True
