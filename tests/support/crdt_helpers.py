"""Shared helpers of the CRDT tests: deterministic keys, making and forging
changes, delivering them, and syncing replicas with the reconcile protocol."""

from __future__ import annotations

from typing import Callable, Iterable

import blake3
import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from crdt.change import Change, decode_change, sign_change
from crdt.document import Document, Transaction
from crdt.reconcile import Reconciler
from crdt.types import ORMap


class Key:
    """An Ed25519 identity derived from a label, so that runs are repeatable
    (Ed25519 signatures are deterministic too)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.private = Ed25519PrivateKey.from_private_bytes(blake3.blake3(label.encode()).digest())
        self.pk = self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.sign = self.private.sign

    def __repr__(self) -> str:
        return f"Key({self.label!r})"


def commit(doc: Document, key: Key, fill: Callable[[Transaction], object], time_ms: int = 0) -> Change:
    """Make one change on ``doc`` as ``key`` (prepare, then receive) and return it."""
    tx = doc.transaction()
    fill(tx)
    change = doc.prepare(tx, key.pk, key.sign, time_ms)
    applied = doc.receive(change)
    assert applied and applied[0] is change
    return change


def forge(doc_id: bytes, key: Key, ops: list, deps: Iterable[Change] = (), *,
          lamport: int | None = None, time_ms: int = 0) -> Change:
    """A validly signed change built by hand (bypassing Document.prepare's checks).

    ``lamport`` defaults to one above the highest of ``deps``.
    """
    deps = list(deps)
    if lamport is None:
        lamport = 1 + max((d.lamport for d in deps), default=0)
    return sign_change(doc_id, key.pk, lamport, [d.id for d in deps], time_ms, ops, key.sign)


def via_wire(change: Change) -> Change:
    """The change as a peer sees it: decoded and signature-checked."""
    return decode_change(change.wire)


def deliver(doc: Document, changes: Iterable[Change]) -> list[Change]:
    """Receive every change (through the wire decoder); return those applied."""
    applied = []
    for change in changes:
        applied += doc.receive(via_wire(change))
    return applied


def _wire(message: object) -> object:
    """A reconcile message as the peer receives it (msgpack round trip)."""
    return msgpack.unpackb(msgpack.packb(message, use_bin_type=True), raw=False)


def reconcile(a: Document, b: Document, **options) -> tuple[set[bytes], set[bytes]]:
    """Run a reconcile session between ``a`` (initiator) and ``b`` to completion;
    return (keys a has that b lacks, keys b has that a lacks)."""
    ra, rb = Reconciler(a.items, **options), Reconciler(b.items, **options)
    message = _wire(ra.initiate())
    side, other = rb, ra
    for _ in range(200):
        reply = side.receive(message)
        if reply is None:
            break
        message = _wire(reply)
        side, other = other, side
    else:  # pragma: no cover
        raise AssertionError("reconciliation did not finish")
    assert ra.have == rb.need and rb.have == ra.need
    assert ra.have == set(a.items) - set(b.items)
    assert rb.have == set(b.items) - set(a.items)
    return set(ra.have), set(rb.have)


def sync(a: Document, b: Document, changes: dict[bytes, Change], **options) -> None:
    """Sync two replicas fully: reconcile, then send each side what it lacks, in key order.

    ``changes`` maps sync keys (``change.key``) to every change ever made;
    ``options`` go to both Reconcilers.
    """
    a_has, b_has = reconcile(a, b, **options)
    deliver(b, [changes[k] for k in sorted(a_has)])
    deliver(a, [changes[k] for k in sorted(b_has)])


def sync_all(docs: list[Document], changes: dict[bytes, Change]) -> None:
    """Everyone gets everything: a star of syncs through docs[0], twice."""
    for _ in range(2):
        for other in docs[1:]:
            sync(docs[0], other, changes)


def snapshot_of(doc: Document) -> tuple:
    """What two converged replicas must agree on."""
    return (doc.root.encode(), sorted(doc.heads), sorted(doc.items), sorted(doc.equivocators),
            sorted(doc.acl.members("writer")), sorted(doc.acl.members("reader")), len(doc))


def live_state(state) -> list:
    """A state as far as readers and later removals can tell: each visible key
    with its kind and the live dots a removal would name, recursively.
    Tombstones (dots already removed) are left out."""
    if isinstance(state, ORMap):
        return [[key, state.visible_kind(key), sorted(map(list, state.subtree_dots(key))),
                 live_state(state.get(key))] for key in sorted(state.keys())]
    return sorted(map(list, state.dots()))


def assert_converged(docs: list[Document], *, encodings: bool = True) -> None:
    """Replicas agree on everything observable; with ``encodings``, also on
    their encoded states (tombstones included), byte for byte."""
    first = docs[0]
    for doc in docs[1:]:
        assert doc.get() == first.get()
        assert live_state(doc.root) == live_state(first.root)
        assert doc.heads == first.heads
        assert set(doc.items) == set(first.items)
        assert doc.equivocators == first.equivocators
        assert doc.acl.members("writer") == first.acl.members("writer")
        assert doc.acl.members("reader") == first.acl.members("reader")
        if encodings:
            assert doc.root.encode() == first.root.encode()
    for doc in docs:
        assert doc.pending == 0
