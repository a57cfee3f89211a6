"""First-come names: the ``/name/`` namespace.

A key ``/name/<name>`` belongs to whoever claims it first.  A name record's
value is ``[claim, payload]``, the claim a map signed by the owner: the key,
the owner's public key, a claim ``seq`` and up to ``MAX_WRITERS`` other keys
the owner lets write the record.  The record itself is signed by its author
as every record is, and the author must be the owner or one of the writers;
what the payload means is for the service that uses the name.

Ownership rests on the replicas, not on a signature anyone can check alone
(nothing self-certifying binds a bare name to a key):

- a replica holding a live record for a name refuses a record under another
  owner (``NameValidator.better`` is false both ways between owners), so the
  first claim to reach a replica keeps it there while its owner refreshes it;
- within one owner the newer claim wins, then the newer record: a writer the
  owner has removed cannot bring its old claim back;
- a reader that gets records of several owners from the replicas takes the
  owner most of them hold (``NameValidator.best``).

A name whose records all expire (its owner and writers gone for longer than
the record's TTL) can be claimed again; readers that remember the owner they
saw (the shard service does) refuse the newcomer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import msgpack

from .ids import PUBLIC_KEY_SIZE
from .records import MAX_INT, SIGNATURE_SIZE, OpenValidator, Record, RecordError, signed_by

NAME_PREFIX = b"/name/"
MAX_WRITERS = 16
_CONTEXT = b"meshd-dht-name/1"


@dataclass(frozen=True)
class Claim:
    """The owner's signed word on who may write the record under ``key``."""

    key: bytes
    owner: bytes
    seq: int
    writers: tuple[bytes, ...]
    signature: bytes

    def signed_bytes(self) -> bytes:
        return msgpack.packb([_CONTEXT, self.key, self.owner, self.seq, list(self.writers)])

    def verify(self) -> bool:
        """Whether the owner signed this claim."""
        return signed_by(self.owner, self.signature, self.signed_bytes())

    def may_write(self, public_key: bytes) -> bool:
        return public_key == self.owner or public_key in self.writers

    def to_wire(self) -> dict:
        return {"k": self.key, "o": self.owner, "seq": self.seq, "w": list(self.writers), "sig": self.signature}

    @classmethod
    def from_wire(cls, obj: object) -> Claim:
        """Parse and check the shape of a claim map (not its signature); RecordError if malformed."""
        if not isinstance(obj, dict) or not {"k", "o", "seq", "w", "sig"} <= obj.keys():
            raise RecordError("a name claim must be a map of k, o, seq, w and sig")
        key, owner, seq, writers, signature = obj["k"], obj["o"], obj["seq"], obj["w"], obj["sig"]
        if not isinstance(key, bytes) or not _is_key(owner) or not isinstance(signature, bytes) \
                or len(signature) != SIGNATURE_SIZE:
            raise RecordError("a name claim needs a key, a 32-byte owner and a 64-byte signature")
        if type(seq) is not int or not 0 <= seq < MAX_INT:
            raise RecordError("a name claim's seq must be an integer in [0, 2**63)")
        if not isinstance(writers, list) or len(writers) > MAX_WRITERS or not all(map(_is_key, writers)):
            raise RecordError(f"a name claim lists at most {MAX_WRITERS} writers, each a 32-byte key")
        return cls(key, owner, seq, tuple(writers), signature)


def _is_key(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == PUBLIC_KEY_SIZE


def name_key(name: str) -> bytes:
    """The record key of ``name`` (``/name/<name>``)."""
    if not name:
        raise RecordError("a name must not be empty")
    return NAME_PREFIX + name.encode()


def sign_claim(key: bytes, *, owner: bytes, sign: Callable[[bytes], bytes], seq: int,
               writers: tuple[bytes, ...] = ()) -> Claim:
    """A claim of ``key`` by ``owner`` (``sign`` is its signing function) letting ``writers`` write."""
    writers = tuple(dict.fromkeys(w for w in writers if w != owner))
    unsigned = Claim(key, owner, seq, writers, bytes(SIGNATURE_SIZE))
    claim = Claim.from_wire(unsigned.to_wire())  # the same checks a reader makes
    return Claim(key, owner, seq, claim.writers, sign(claim.signed_bytes()))


def name_value(claim: Claim, payload: bytes) -> bytes:
    """The record value carrying ``claim`` and ``payload``."""
    return msgpack.packb([claim.to_wire(), payload])


def parse_name_value(value: bytes) -> tuple[Claim, bytes]:
    """``(claim, payload)`` of a name record's value; RecordError if malformed.
    Does not verify the claim's signature."""
    try:
        parsed = msgpack.unpackb(value, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise RecordError(f"a name record's value is not msgpack: {exc}") from None
    if not isinstance(parsed, list) or len(parsed) != 2 or not isinstance(parsed[1], bytes):
        raise RecordError("a name record's value must be [claim, payload bytes]")
    return Claim.from_wire(parsed[0]), parsed[1]


class NameValidator(OpenValidator):
    """``/name/<name>``: as ``/open/``, and the value carries the owner's claim
    of this very key, whose signature verifies and which lets the record's
    author write.  Between owners, neither record is better: a replica keeps
    the owner it has (see the module docstring)."""

    def validate(self, record: Record, now: float) -> None:
        if not record.key.startswith(NAME_PREFIX) or len(record.key) == len(NAME_PREFIX):
            raise RecordError("a /name/ key must look like /name/<name>")
        claim, _ = parse_name_value(record.value)
        if claim.key != record.key:
            raise RecordError("the name claim is for another key")
        if not claim.verify():
            raise RecordError("the name claim's signature does not verify with its owner's key")
        if not claim.may_write(record.public_key):
            raise RecordError("the record's author is neither the name's owner nor a writer it allows")
        super().validate(record, now)

    def better(self, a: Record, b: Record) -> bool:
        claim_a, claim_b = (parse_name_value(r.value)[0] for r in (a, b))
        if claim_a.owner != claim_b.owner:
            return False
        return (claim_a.seq, a.seq, a.expires, a.signature) > (claim_b.seq, b.seq, b.expires, b.signature)

    def best(self, records: list[Record]) -> Record:
        """The best record of the owner most of ``records`` name (ties: the
        owner listed first, so the caller's own copy when it comes first)."""
        owners = [parse_name_value(r.value)[0].owner for r in records]
        owner = max(dict.fromkeys(owners), key=owners.count)
        best = None
        for record, of in zip(records, owners):
            if of == owner and (best is None or self.better(record, best)):
                best = record
        return best
