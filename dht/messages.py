"""Checked decoding of DHT messages from peers.

Every field a peer sends goes through one of these functions, which check
type, count and size and raise :class:`~dht.network.Refused` with the reason.
A bad request costs the sender its answer; a bad reply counts as a failed
query of the peer that sent it.
"""

from __future__ import annotations

from .ids import Contact, ContactError
from .network import Refused
from .records import MAX_KEY

MAX_BULK = 16  # keys, ids or records in one request (what a node sends; what it accepts by default)
MAX_NODES = 32  # contacts per key in one reply
MAX_PROVIDERS = 64  # providers per key in one reply
ID_SIZE = 32


def field_list(msg: object, name: str, limit: int) -> list:
    """``msg[name]``, a list of 1..``limit`` items."""
    if not isinstance(msg, dict):
        raise Refused("a DHT message must be a map")
    items = msg.get(name)
    if not isinstance(items, list) or not 0 < len(items) <= limit:
        raise Refused(f"{name!r} must be a list of 1 to {limit} items")
    return items


def keys(msg: object, limit: int = MAX_BULK) -> list[bytes]:
    """The ``keys`` of a request: 1..``limit`` byte strings of 1..MAX_KEY bytes."""
    items = field_list(msg, "keys", limit)
    if not all(isinstance(k, bytes) and 0 < len(k) <= MAX_KEY for k in items):
        raise Refused(f"keys must be byte strings of 1 to {MAX_KEY} bytes")
    return items


def ids(msg: object, limit: int = MAX_BULK) -> list[bytes]:
    """The ``ids`` of a FIND_NODE request: 1..``limit`` ids of 32 bytes."""
    items = field_list(msg, "ids", limit)
    if not all(isinstance(i, bytes) and len(i) == ID_SIZE for i in items):
        raise Refused(f"ids must be {ID_SIZE} bytes each")
    return items


def contact(obj: object) -> Contact:
    try:
        return Contact.from_wire(obj)
    except ContactError as exc:
        raise Refused(str(exc)) from None


def addrs(obj: object, name: str) -> tuple[str, ...]:
    """A list of addresses, checked as a contact's are."""
    if not isinstance(obj, list):
        raise Refused(f"{name!r} must be a list of addresses")
    return contact({"pk": bytes(32), "a": obj}).addrs


def sender_addrs(msg: dict) -> tuple[str, ...] | None:
    """The addresses a server-mode sender gives in ``from``; None for a client-mode sender."""
    claimed = msg.get("from")
    return None if claimed is None else addrs(claimed, "from")


def per_key(reply: object, name: str, count: int) -> list:
    """``reply[name]``: exactly one entry per key asked."""
    if not isinstance(reply, dict):
        raise Refused("a DHT reply must be a map")
    items = reply.get(name)
    if not isinstance(items, list) or len(items) != count:
        raise Refused(f"reply field {name!r} must hold one entry per key asked")
    return items


def nodes(obj: object) -> list[Contact]:
    """A list of at most MAX_NODES contacts."""
    if not isinstance(obj, list) or len(obj) > MAX_NODES:
        raise Refused(f"a node list holds at most {MAX_NODES} contacts")
    return [contact(item) for item in obj]


def is_server(reply: object) -> bool:
    return isinstance(reply, dict) and reply.get("server") is True
