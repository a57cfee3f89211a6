"""A document kept by a node, and what the control plane says of it.

:class:`Replica` is one document with its known peers, outgoing changes and
watchers; :class:`Watcher` streams the changes applied to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import trio

from crdt.change import COUNT, DELETE, GRANT, GROW, REVOKE, Change
from crdt.document import OP_NAMES, Document

from ...identity import PeerId, PeerIdError

WATCH_BUFFER = 10_000  # changes a watcher may fall behind before its stream is ended


class DocError(Exception):
    """A document reference or write that cannot be served (the message says why)."""


def parse_ref(text: str, own_key: bytes) -> tuple[bytes, str]:
    """``(owner key, name)`` from ``NAME`` (ours) or ``PEERID/NAME``."""
    head, sep, rest = text.partition("/")
    if sep:
        try:
            return PeerId.from_string(head).key, rest
        except PeerIdError:
            pass
    return own_key, text


def plain(value: object) -> object:
    """A document value as msgpack can carry it: sets become sorted lists."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=lambda v: msgpack.packb(v))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def describe(change: Change, *, local: bool) -> dict:
    """A change as watchers see it."""
    out = []
    for op in change.ops:
        code, name = op[0], OP_NAMES[op[0]]
        if code in (GRANT, REVOKE):
            out.append({"op": name, "role": op[1], "key": str(PeerId(op[2]))})
        elif code in (GROW, COUNT):  # the author's running total, not the increment
            out.append({"op": name, "path": op[1], "total": op[2] - (op[3] if code == COUNT else 0)})
        elif code == DELETE:
            out.append({"op": name, "path": op[1]})
        else:
            out.append({"op": name, "path": op[1], "value": op[2]})
    return {"change": change.id.hex(), "author": str(PeerId(change.author)), "local": local,
            "time_ms": change.time_ms, "ops": out}


@dataclass(eq=False)
class Watcher:
    """Changes applied to one document, as :func:`describe` gives them, from
    ``events``; ``lagged`` says the stream ended because its reader fell behind."""

    send: trio.MemorySendChannel
    events: trio.MemoryReceiveChannel
    lagged: bool = False


@dataclass(eq=False)
class Replica:
    doc: Document
    peers: dict[PeerId, None] = field(default_factory=dict)  # known replicas, newest last
    outbox: list[tuple[Change, PeerId | None]] = field(default_factory=list)
    queued: trio.Event = field(default_factory=trio.Event)
    wake: trio.Event = field(default_factory=trio.Event)
    synced: trio.Event = field(default_factory=trio.Event)  # the first sync round is over
    watchers: set = field(default_factory=set)
    since_compact: int = 0

    @property
    def ref(self) -> str:
        return f"{PeerId(self.doc.owner)}/{self.doc.name}"
