"""256-bit ids, the XOR metric, and contacts.

A node's id is sha256 of its raw 32-byte Ed25519 public key; a key's id is
sha256 of the key bytes.  Distances are XOR of ids read as big-endian
integers, so ``bucket_index`` is the position of the highest differing bit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

ID_BITS = 256
PUBLIC_KEY_SIZE = 32
MAX_ADDRS = 8  # addresses kept per contact
MAX_ADDR_LEN = 128


class ContactError(ValueError):
    """A contact received from a peer is malformed."""


def node_id(public_key: bytes) -> bytes:
    """The DHT id of a node: sha256 of its Ed25519 public key."""
    return hashlib.sha256(public_key).digest()


def key_id(key: bytes) -> bytes:
    """The DHT id of a key: sha256 of the key bytes."""
    return hashlib.sha256(key).digest()


def distance(a: bytes, b: bytes) -> int:
    """XOR distance between two 32-byte ids."""
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


def bucket_index(own: bytes, other: bytes) -> int:
    """Index of the k-bucket ``other`` falls in, seen from ``own``: 255 for the
    farthest half of the id space, 0 for ids that differ only in the last bit.
    Raises ValueError for ``own`` itself."""
    d = distance(own, other)
    if d == 0:
        raise ValueError("an id has no bucket relative to itself")
    return d.bit_length() - 1


@dataclass(frozen=True, eq=False)
class Contact:
    """A peer as the DHT knows it: its public key and where to reach it.

    Equality and hashing go by public key only: the same peer with new
    addresses is the same contact.
    """

    public_key: bytes
    addrs: tuple[str, ...] = ()
    id: bytes = field(init=False, repr=False)
    num: int = field(init=False, repr=False)  # ``id`` as an integer, for fast XOR

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", node_id(self.public_key))
        object.__setattr__(self, "num", int.from_bytes(self.id, "big"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Contact) and other.public_key == self.public_key

    def __hash__(self) -> int:
        return hash(self.public_key)

    def to_wire(self) -> dict:
        return {"pk": self.public_key, "a": list(self.addrs)}

    @classmethod
    def from_wire(cls, obj: object) -> "Contact":
        """Parse ``{"pk": bytes, "a": [str]}``; raises ContactError when malformed."""
        if not isinstance(obj, dict):
            raise ContactError("a contact must be a map")
        pk, addrs = obj.get("pk"), obj.get("a", [])
        if not isinstance(pk, bytes) or len(pk) != PUBLIC_KEY_SIZE:
            raise ContactError(f"a contact's public key must be {PUBLIC_KEY_SIZE} bytes")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS:
            raise ContactError(f"a contact carries a list of at most {MAX_ADDRS} addresses")
        if not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDR_LEN for a in addrs):
            raise ContactError(f"contact addresses must be strings of 1-{MAX_ADDR_LEN} characters")
        return cls(pk, tuple(addrs))
