"""The control-socket methods for replicated documents (``crdt.*``).

A document is named ``NAME`` (one this node owns) or ``PEERID/NAME``.  Writes
take a list of operations, ``[op, path, *args]``, made into one signed change
(a transaction) and acknowledged once it is on disk:

=========================  ===============================================
``["set", path, value]``   last-writer-wins register
``["assign", path, v]``    multi-value register
``["inc", path, n]``       counter (n may be negative)
``["grow", path, n]``      grow-only counter (n > 0)
``["add", path, e]``       add-wins set: add element (int, str or bytes)
``["remove", path, e]``    add-wins set: remove element
``["delete", path]``       remove a map key and what is below it
``["grant", peer, role]``  owner only; role ``writer`` or ``reader``;
                           peer ``"anyone"`` as reader makes it public
``["revoke", peer, role]`` owner only
=========================  ===============================================
"""

from __future__ import annotations

import trio

from crdt.change import ChangeError
from crdt.document import ANYONE, Transaction

from ...identity import PeerId
from ...rpc import InvalidArgument, NotFound, ResourceExhausted, RpcError
from ...rpc.args import field, to_peer
from .replica import WATCH_BUFFER, DocError, Replica, plain

_ARITY = {"set": 2, "assign": 2, "inc": 2, "grow": 2, "add": 2, "remove": 2, "delete": 1, "grant": 2, "revoke": 2}


def info(replica: Replica, me: PeerId) -> dict:
    """What ``crdt.info`` and ``crdt.ls`` say about a document."""
    doc = replica.doc
    readers = doc.acl.members("reader")
    return {
        "doc": replica.ref, "id": doc.id.hex(), "owner": str(PeerId(doc.owner)), "name": doc.name,
        "changes": len(doc), "heads": len(doc.heads), "pending": doc.pending,
        "peers": [str(p) for p in replica.peers],
        "writers": sorted(str(PeerId(k)) for k in doc.acl.members("writer")),
        "readers": sorted(str(PeerId(k)) for k in readers if k != ANYONE),
        "public": ANYONE in readers, "writable": doc.acl.may_write(me.key),
        "equivocators": sorted(str(PeerId(k)) for k in doc.equivocators),
    }


def control_methods(docs, me: PeerId) -> dict:
    """The ``crdt.*`` control methods, bound to ``docs``, the node ``me``'s
    :class:`~meshd.services.crdt.Crdt` service (not imported here: it imports this module)."""

    def replica_of(arg) -> Replica:
        try:
            return docs.get(field(arg, "doc", str))
        except DocError as exc:
            raise NotFound(str(exc)) from None

    async def open_(arg, ctx):
        try:
            replica = await docs.open(field(arg, "doc", str), create=bool(arg.get("create")))
        except DocError as exc:
            raise InvalidArgument(str(exc)) from None
        return info(replica, me)

    async def ls(arg, ctx):
        return [info(r, me) for r in docs.replicas()]

    async def info_(arg, ctx):
        return info(replica_of(arg), me)

    async def get(arg, ctx):
        replica = replica_of(arg)
        path = arg.get("path") or []
        if not isinstance(path, list) or not all(isinstance(k, str) for k in path):
            raise InvalidArgument("path must be a list of keys")
        return {"value": plain(replica.doc.get(path))}

    async def write(arg, ctx):
        replica = replica_of(arg)
        entries = arg.get("ops")
        if not isinstance(entries, list) or not 0 < len(entries) <= docs.max_ops:
            raise InvalidArgument(f"ops must be a list of 1 to {docs.max_ops} operations")
        try:
            change = await docs.write_shared(replica, lambda tx: _record(tx, entries))
        except DocError as exc:
            raise InvalidArgument(str(exc)) from None
        return {"change": change.id.hex(), "lamport": change.lamport}

    async def watch(arg, ctx):
        replica = replica_of(arg)
        with docs.subscribe(replica) as watcher:
            yield {"watching": replica.ref, "changes": len(replica.doc)}
            async for event in watcher.events:
                yield event
        if watcher.lagged:
            raise ResourceExhausted(f"the watcher fell more than {WATCH_BUFFER} changes behind; "
                                    "read the document again and watch anew")

    async def sync(arg, ctx):
        replica = replica_of(arg)
        if arg.get("peer"):
            return {arg["peer"]: await docs.sync(replica, to_peer(arg["peer"]))}
        peers, results = list(replica.peers), {}  # every known replica at once; one that fails says why

        async def one(peer) -> None:
            try:
                results[peer] = await docs.sync(replica, peer)
            except RpcError as exc:
                results[peer] = {"error": str(exc)}

        async with trio.open_nursery() as nursery:  # one slow or gone replica costs its own timeout, not the sum
            for peer in peers:
                nursery.start_soon(one, peer)
        return {str(peer): results[peer] for peer in peers}

    async def compact(arg, ctx):
        replica = replica_of(arg)
        return {"folded": docs.store.compact(replica.doc)}

    async def forget(arg, ctx):
        replica = replica_of(arg)
        docs.forget(replica.ref)
        return {"forgotten": replica.ref}

    return {"crdt.open": open_, "crdt.ls": ls, "crdt.info": info_, "crdt.get": get,
            "crdt.write": write, "crdt.watch": watch, "crdt.sync": sync,
            "crdt.compact": compact, "crdt.forget": forget}


def _peer(text: object) -> PeerId:
    """The PeerId an operation names (``"anyone"`` for every reader); ChangeError if none."""
    if text == "anyone":
        return PeerId(ANYONE)
    try:
        return to_peer(text)
    except InvalidArgument as exc:
        raise ChangeError(f"{exc.message}: {text!r}") from None


def _record(tx: Transaction, entries: list) -> None:
    """Record the control-socket operations ``entries`` in ``tx``; ChangeError if one is bad."""
    for entry in entries:
        if not isinstance(entry, list) or not entry or not isinstance(entry[0], str):
            raise ChangeError(f"an operation is [name, path, *args], not {entry!r:.60}")
        name, args = entry[0], entry[1:]
        if _ARITY.get(name) != len(args):
            raise ChangeError(f"unknown operation or wrong arguments: {entry!r:.60}")
        if name in ("grant", "revoke"):
            getattr(tx, name)(_peer(args[0]).key, args[1])
        elif name == "grow":
            tx.inc(args[0], args[1], grow_only=True)
        else:
            getattr(tx, name)(*args)
