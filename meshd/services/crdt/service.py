"""Replicated documents (:mod:`crdt`) kept by a node and synced with peers.

Each document a node keeps lives in ``DATA_DIR/crdt.sqlite`` and in memory.
Replicas find each other through DHT provider records under
``b"/crdt/" + doc id``.  Two replicas sync over one bidi RPC call,
``crdt.sync``: range-based reconciliation of their change sets, then each
sends the changes the other lacks.  A change made here, or new to us from a
peer, is pushed at once (``crdt.push``, batched per peer) to the replicas we
know; a sync with a known replica every ``crdt.sync_interval`` seconds catches
up whatever a push missed.

A local write is acknowledged only after its change is on disk.  A peer must
be allowed to read a document to sync or push it; changes are admitted only
if their author may write (see :mod:`crdt.document`).  A change that does not
decode or verify costs the sender its call (INVALID_ARGUMENT).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sqlite3
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import trio

from crdt.change import Change, ChangeError, decode_change, verify_signature
from crdt.document import Document, Rejected, Transaction, check_name, doc_id
from crdt.reconcile import ReconcileError
from crdt.session import sync_session
from crdt.store import Store
from dht.network import DhtError
from dht.ratelimit import RateLimiter

from ...histogram import Histogram
from ...identity import PeerId
from ...rpc import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, RpcError, Unavailable
from ...rpc.args import field
from ...service import Host, Method, Providers
from .config import CrdtSection
from .control import control_methods
from .replica import WATCH_BUFFER, DocError, Replica, Watcher, describe, parse_ref

log = logging.getLogger("meshd.crdt")

DB_FILE = "crdt.sqlite"
PROVIDER_PREFIX = b"/crdt/"
RELAY_FANOUT = 3  # peers a change received from another peer is passed on to
_SYNC_TIMEOUT = 60.0
_PUSH_TIMEOUT = 10.0


class _Batch:
    """Local writes that share one commit."""

    def __init__(self) -> None:
        self.writes: list[tuple[Replica, list[Change]]] = []
        self.done = trio.Event()
        self.error: DocError | None = None


class Crdt:
    """The documents a node keeps, and their replication (service ``crdt``, config ``[crdt]``)."""

    name = "crdt"

    def __init__(self, host: Host, config: CrdtSection, *, providers: Providers):
        self._node = host
        self._config = config
        self._providers = providers
        self.store = Store(host.data_dir / DB_FILE)
        self._replicas: dict[bytes, Replica] = {}
        self._limiter = RateLimiter(config.peer_rate, config.peer_burst)
        self._nursery: trio.Nursery | None = None
        self._batch: _Batch | None = None  # writes waiting for the next group commit
        self._lag = Histogram()  # seconds from a peer's write to its change applied here

    def rpc_methods(self) -> dict:
        return {"crdt.sync": Method(self._serve_sync, "bidi"), "crdt.push": self._serve_push}

    def control_methods(self) -> dict:
        return control_methods(self, self._node.peer_id)

    def status(self) -> dict:
        return {"documents": len(self._replicas)}

    def figures(self) -> dict:
        """For the metrics service: documents kept, changes not yet pushed to peers, and
        the sync lag (seconds from a change's signing time at its author to its arrival
        here, clocks permitting; our own writes are not counted)."""
        return {"documents": len(self._replicas),
                "unsent_changes": sum(len(r.outbox) for r in self._replicas.values()),
                "sync_lag_seconds": self._lag.snapshot()}

    def close(self) -> None:
        self.store.close()

    # --- keeping documents ---------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Load the stored documents and replicate them until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for owner, name in self.store.documents():
                self._start(self.store.load(owner, name, **self._doc_options()))
            task_status.started()
            await trio.sleep_forever()

    def _doc_options(self) -> dict:
        config = self._config
        return {"max_pending": config.max_pending, "max_change": config.max_change, "max_ops": config.max_ops}

    @property
    def max_ops(self) -> int:
        """Operations one change may hold here (``crdt.max_ops``)."""
        return self._config.max_ops

    def _start(self, doc: Document) -> Replica:
        replica = self._replicas[doc.id] = Replica(doc)
        self._nursery.start_soon(self._replicate, replica)
        self._nursery.start_soon(self._push_loop, replica)
        return replica

    async def open(self, ref: str, *, create: bool = False) -> Replica:
        """The replica of document ``ref`` (``NAME`` or ``PEERID/NAME``).

        A document of our own is created when ``create`` is set; another
        node's is joined: we start replicating it and wait (up to
        ``crdt.join_timeout`` s) for a first sync with its replicas.
        """
        owner, name = self._parse(ref)
        replica = self._replicas.get(doc_id(owner, name))
        if replica is not None:
            return replica
        if owner == self._node.peer_id.key and not create:
            raise DocError(f"no document {name!r} here (create it first)")
        doc = Document(owner, name, **self._doc_options())
        self.store.add_document(doc)
        replica = self._start(doc)
        if owner != self._node.peer_id.key:
            with trio.move_on_after(self._config.join_timeout):
                await replica.synced.wait()
        return replica

    def is_own(self, ref: str) -> bool:
        """Whether ``ref`` names a document this node owns."""
        return self._parse(ref)[0] == self._node.peer_id.key

    def get(self, ref: str) -> Replica:
        """The replica of ``ref`` if this node keeps it; DocError otherwise."""
        replica = self._replicas.get(doc_id(*self._parse(ref)))
        if replica is None:
            raise DocError(f"this node does not keep {ref!r} (open it first)")
        return replica

    def _parse(self, ref: str) -> tuple[bytes, str]:
        owner, name = parse_ref(ref, self._node.peer_id.key)
        try:
            check_name(name)
        except ValueError as exc:
            raise DocError(str(exc)) from None
        return owner, name

    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def forget(self, ref: str) -> None:
        """Stop keeping ``ref`` and delete it from disk."""
        replica = self.get(ref)
        del self._replicas[replica.doc.id]
        self.store.remove_document(replica.doc.id)
        self._providers.unprovide(PROVIDER_PREFIX + replica.doc.id)
        replica.wake.set()  # its loops see it is gone and return
        replica.queued.set()
        for watcher in replica.watchers:
            watcher.send.close()

    # --- local writes and reads ------------------------------------------------------

    def write(self, replica: Replica, fill: Callable[[Transaction], None]) -> Change:
        """Make one change with the operations ``fill`` records; returns once it is on disk.

        Raises DocError if this node may not write, or an operation is bad.
        """
        change = self._make(replica, fill)
        self._save([(replica, [change])])
        self._applied(replica, [change], source=None)
        return change

    async def write_shared(self, replica: Replica, fill: Callable[[Transaction], None]) -> Change:
        """:meth:`write`, committed together with the other writes made meanwhile (one
        transaction, one fsync for all: group commit); returns once it is on disk."""
        change = self._make(replica, fill)
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
            self._nursery.start_soon(self._commit, batch)
        batch.writes.append((replica, [change]))
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error
        return change

    async def _commit(self, batch: "_Batch") -> None:
        await trio.lowlevel.cancel_shielded_checkpoint()  # writes scheduled with the first one join it
        self._batch = None
        try:
            self._save(batch.writes)
        except DocError as exc:
            batch.error = exc
        else:
            for replica, changes in batch.writes:
                self._applied(replica, changes, source=None)
        batch.done.set()

    def _make(self, replica: Replica, fill: Callable[[Transaction], None]) -> Change:
        """One signed change with what ``fill`` records, applied in memory (not stored yet)."""
        doc = replica.doc
        tx = doc.transaction()
        try:
            fill(tx)
            change = doc.prepare(tx, self._node.peer_id.key, self._node.identity.sign,
                                 int(time.time() * 1000))
            doc.receive(change)
        except (ChangeError, Rejected) as exc:
            raise DocError(str(exc)) from None
        return change

    def _save(self, writes: list[tuple[Replica, list[Change]]], *, durable: bool = True) -> None:
        """Store changes already applied in memory, in one transaction (``durable``:
        safe from a power cut, for this node's own writes).  If the disk refuses them,
        their replicas are reloaded from disk (so memory holds nothing the disk lacks:
        peers are never offered a change we cannot send) and DocError is raised."""
        try:
            self.store.save_many([(replica.doc, changes) for replica, changes in writes], durable=durable)
        except (sqlite3.Error, OSError) as exc:
            for replica in {id(r): r for r, _ in writes}.values():
                replica.doc = self.store.load(replica.doc.owner, replica.doc.name,
                                              max_pending=self._config.max_pending)
            raise DocError(f"could not store the change: {exc}") from None

    @contextmanager
    def subscribe(self, replica: Replica) -> Iterator[Watcher]:
        """A :class:`Watcher` of every change applied to the document from now on."""
        watcher = Watcher(*trio.open_memory_channel(WATCH_BUFFER))
        replica.watchers.add(watcher)
        try:
            with watcher.events:
                yield watcher
        finally:
            replica.watchers.discard(watcher)

    def _applied(self, replica: Replica, changes: list[Change], source: PeerId | None) -> None:
        """Tell watchers, queue pushes, count the sync lag of a peer's changes, and
        compact now and then."""
        if source is not None:
            now_ms = time.time() * 1000
            for change in changes:
                self._lag.observe(max(0.0, now_ms - change.time_ms) / 1000)
        for watcher in list(replica.watchers):
            for change in changes:
                try:
                    watcher.send.send_nowait(describe(change, local=source is None))
                except trio.WouldBlock:  # it fell behind: its stream ends, saying so
                    replica.watchers.discard(watcher)
                    watcher.lagged = True
                    watcher.send.close()
                    break
        replica.outbox.extend((change, source) for change in changes)
        replica.queued.set()
        replica.since_compact += len(changes)
        if replica.since_compact >= self._config.compact_every:
            self.store.compact(replica.doc)
            replica.since_compact = 0

    def _ingest(self, replica: Replica, wires: object, source: PeerId) -> int:
        """Apply changes a peer sent; returns how many were new.  A change that does
        not decode costs the peer its call; one the document refuses is skipped."""
        if not isinstance(wires, list):
            raise InvalidArgument("changes must be a list")
        applied: list[Change] = []
        try:
            for wire in wires:
                try:
                    change = decode_change(wire, verify=False, max_change=self._config.max_change,
                                           max_ops=self._config.max_ops)
                    if change.id in replica.doc:
                        continue  # a copy we have: most pushes are, so skip the signature check
                    if not self._limiter.allow(source, trio.current_time()):
                        raise ResourceExhausted(
                            f"over {self._config.peer_rate:g} new changes per second from one peer")
                    verify_signature(change)
                except ChangeError as exc:
                    raise InvalidArgument(f"bad change: {exc}") from None
                try:
                    applied += replica.doc.receive(change)
                except Rejected as exc:
                    log.info("%s: refused a change from %s: %s", replica.ref, source.short(), exc)
        finally:  # what was applied is stored, even when the rest of the batch is refused
            if applied:
                try:  # a peer's changes: their authors keep them, so no fsync for each push
                    self._save([(replica, applied)], durable=False)
                except DocError as exc:
                    raise Unavailable(str(exc)) from None
                self._applied(replica, applied, source)
        if replica.doc.pending:
            replica.peers[source] = None
            replica.wake.set()
        return len(applied)

    # --- replication ---------------------------------------------------------------------

    async def _replicate(self, replica: Replica) -> None:
        """Announce the document, find its other replicas, and sync with them now and then."""
        key = PROVIDER_PREFIX + replica.doc.id
        dht, config = self._providers, self._config
        next_discovery, provided = 0.0, False
        owner = PeerId(replica.doc.owner)
        if owner != self._node.peer_id:
            replica.peers[owner] = None  # the owner keeps its documents: a replica to start from
        while replica.doc.id in self._replicas:
            if trio.current_time() >= next_discovery:
                next_discovery = trio.current_time() + config.discover_interval
                try:
                    if not provided:  # once others took it, the DHT re-announces it itself
                        provided = await dht.provide(key) > 0
                    for contact in await dht.find_providers(key, config.max_peers):
                        peer = PeerId(contact.public_key)
                        if peer != self._node.peer_id and peer not in replica.peers:
                            replica.peers[peer] = None
                except DhtError as exc:
                    log.debug("%s: provider lookup failed: %s", replica.ref, exc)
            peers = list(replica.peers)
            chosen = peers if not replica.synced.is_set() else random.sample(peers, min(2, len(peers)))
            replica.wake = trio.Event()  # a wake-up during these syncs runs another round at once
            async with trio.open_nursery() as nursery:
                for peer in chosen:
                    nursery.start_soon(self._sync_quietly, replica, peer)
            replica.synced.set()
            with trio.move_on_after(config.sync_interval):
                await replica.wake.wait()

    async def _sync_quietly(self, replica: Replica, peer: PeerId) -> None:
        try:
            await self.sync(replica, peer)
        except (RpcError, ReconcileError, trio.BrokenResourceError) as exc:
            log.debug("%s: sync with %s failed: %s", replica.ref, peer.short(), exc)
            if isinstance(exc, (NotFound, PermissionDenied)):
                replica.peers.pop(peer, None)

    async def sync(self, replica: Replica, peer: PeerId) -> dict:
        """Reconcile with ``peer`` now: returns ``{"sent", "received", "rounds"}``."""
        arg = {"doc": replica.doc.id}
        async with self._node.rpc.bidi(peer, "crdt.sync", arg, timeout=_SYNC_TIMEOUT) as channel:
            result = await self._session(replica, peer, channel, initiator=True)
        replica.peers[peer] = None
        return result

    def _readable(self, arg: object, peer: PeerId) -> Replica:
        """The replica a peer's ``{doc: id, ...}`` names, if we keep it and the peer may read it."""
        replica = self._replicas.get(field(arg, "doc", bytes))
        if replica is None:
            raise NotFound("this node does not keep that document")
        if not replica.doc.acl.may_read(peer.key):
            raise PermissionDenied("you may not read this document")
        return replica

    async def _serve_sync(self, channel, ctx) -> None:
        replica = self._readable(channel.arg, ctx.peer)
        await self._session(replica, ctx.peer, channel, initiator=False)
        replica.peers[ctx.peer] = None

    async def _session(self, replica: Replica, peer: PeerId, channel, *, initiator: bool) -> dict:
        """Reconcile over ``channel``, then exchange the changes each side lacks."""
        doc = replica.doc
        wires = (lambda keys: self.store.wires(doc.id, keys)) if doc.acl.may_read(peer.key) else None
        try:
            result = await sync_session(channel, doc.items, initiator=initiator, wires=wires,
                                        ingest=lambda batch: self._ingest(replica, batch, peer))
        except ReconcileError as exc:
            raise InvalidArgument(f"bad reconciliation message: {exc}") from None
        return dataclasses.asdict(result)

    async def _serve_push(self, arg, ctx) -> dict:
        replica = self._readable(arg, ctx.peer)
        return {"new": self._ingest(replica, arg.get("changes"), ctx.peer)}

    async def _push_loop(self, replica: Replica) -> None:
        """Send queued changes on: ours to every known replica, those from a peer
        to ``RELAY_FANOUT`` random others (their author pushed to its own peers)."""
        while replica.doc.id in self._replicas:
            await replica.queued.wait()
            replica.queued = trio.Event()
            outbox, replica.outbox = replica.outbox, []
            peers = list(replica.peers)[-self._config.max_peers:]
            relays = set(random.sample(peers, min(RELAY_FANOUT, len(peers))))
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    wires = [c.wire for c, source in outbox
                             if source is None or (source != peer and peer in relays)]
                    if wires and replica.doc.acl.may_read(peer.key):
                        nursery.start_soon(self._push, replica, peer, wires)

    async def _push(self, replica: Replica, peer: PeerId, wires: list[bytes]) -> None:
        arg = {"doc": replica.doc.id, "changes": wires}
        try:
            await self._node.rpc.call(peer, "crdt.push", arg, timeout=_PUSH_TIMEOUT)
        except RpcError as exc:
            log.debug("%s: push to %s failed: %s", replica.ref, peer.short(), exc)
            replica.peers.pop(peer, None)
