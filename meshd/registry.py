"""Registry documents: replicated documents in which peers list what they have, or what they are.

Services keep such listings in the crdt service's documents, which they reach
through the :class:`~meshd.service.Documents` protocol the composition root
wires in: the models ``shards`` keeps, the experts ``experts`` serves, the
members of a training group (``learning``).  What they share is here:

* :func:`open_registry`: the document, created (readable by anyone) if it
  is this node's and new;
* :func:`catch_up`: sync it once with every replica known, at once, each
  for at most a timeout;
* :func:`own_entries`: the entries kept under peer ids that their own peer
  wrote.  The crdt layer lets a writer write any path, so where an entry
  speaks for a peer, readers trust it only if the change that set its
  current value was signed by that peer's key.
"""

from __future__ import annotations

import logging

import trio

from crdt.document import ANYONE, Document
from crdt.reconcile import ReconcileError
from crdt.types import LWWRegister, ORMap

from .identity import PeerId, PeerIdError
from .rpc import RpcError
from .service import Documents, Replica

log = logging.getLogger("meshd.registry")


async def open_registry(documents: Documents, ref: str) -> Replica:
    """The replica of ``ref`` (``NAME`` or ``PEERID/NAME``): created, with anyone
    allowed to read it, if this node owns it and it is new; joined otherwise."""
    ours = documents.is_own(ref)
    replica = await documents.open(ref, create=ours)
    if ours and len(replica.doc) == 0:
        documents.write(replica, lambda tx: tx.grant(ANYONE, "reader"))
    return replica


async def catch_up(documents: Documents, replica: Replica, *, timeout: float) -> None:
    """Sync ``replica`` once with each replica it knows, all at once, each for at
    most ``timeout`` seconds (a dead replica costs one timeout); failures are logged."""

    async def sync(peer: PeerId) -> None:
        try:
            with trio.move_on_after(timeout):
                await documents.sync(replica, peer)
        except (RpcError, ReconcileError, OSError) as exc:
            log.debug("%s: no sync with %s (%s)", replica.ref, peer.short(), exc)

    async with trio.open_nursery() as nursery:
        for peer in list(replica.peers):
            nursery.start_soon(sync, peer)


def own_entries(doc: Document, path: list[str]) -> tuple[dict[str, object], list[str]]:
    """The entries of the map at ``path`` that their peer wrote itself, and the keys of the others.

    An entry is a key that is a peer id (its text form) holding one
    last-writer-wins register (``tx.set([*path, key], value)``) whose current
    value was written by that peer.  Returns (peer id text -> value, sorted
    keys that are not: another key's write, another kind of state, not a peer id).
    """
    node = doc.state(path)
    if not isinstance(node, ORMap):
        return {}, []
    own: dict[str, object] = {}
    other: list[str] = []
    for key in node.keys():
        state = node.get(key)
        try:
            author = PeerId.from_string(key)
        except PeerIdError:
            author = None
        if (author is not None and str(author) == key and isinstance(state, LWWRegister)
                and state.live() and state.dot[1] == author.key):
            own[key] = state.value()
        else:
            other.append(key)
    return own, sorted(other)
