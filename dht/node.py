"""A DHT node: lookups, values and providers over any :class:`~dht.network.Network`.

The protocol logic lives in the sans-IO parts (:mod:`dht.routing`,
:mod:`dht.lookup`, :mod:`dht.records`, :mod:`dht.storage`); this module is
the trio shell that sends the queries, runs the timers and shares work:
concurrent lookups of the same target run once.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from . import messages as m
from .ids import MAX_ADDRS, Contact, key_id
from .lookup import Lookup
from .network import (ADD_PROVIDER, FIND_NODE, GET_PROVIDERS, GET_VALUE, PING, PUT_VALUE,
                      DhtError, Network, Refused, Unreachable)
from .ratelimit import RateLimiter
from .records import Record, RecordError, sign_record
from .validators import Validators
from .routing import V4_PREFIX, V6_PREFIX, RoutingTable
from .server import DhtServer
from .storage import (MAX_PER_AUTHOR, MAX_PROVIDER_KEYS, MAX_PROVIDERS, MAX_PROVIDERS_PER_KEY, MAX_RECORD_BYTES,
                      MAX_RECORDS, Database, ProviderStore, RecordStore)

log = logging.getLogger("dht")
_STAGGER = 0.1  # seconds a put's first stores have alone before the rest are sent
_MAX_FAILED = 4096  # nodes remembered as recently failed
MAX_PROVIDER_ADDRS = 4096  # providers whose addresses are remembered for dialing them


class _Ewma:
    """An exponentially weighted mean of durations (None before the first)."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self.value: float | None = None

    def observe(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)


class _Sends:
    """One request sent to many contacts, each at most once, and who accepted it
    (a reply whose ``stored`` list holds one None)."""

    def __init__(self, node: "DhtNode", method: str, msg: dict):
        self._node, self._method, self._msg = node, method, msg
        self._accepted: dict[bytes, bool | None] = {}  # public key -> None while in flight
        self._changed = trio.Event()

    def start(self, nursery: trio.Nursery, contacts: list[Contact]) -> None:
        """Send to each of ``contacts`` not sent to yet, in ``nursery``."""
        for contact in contacts:
            if contact.public_key not in self._accepted:
                self._accepted[contact.public_key] = None
                nursery.start_soon(self._send, contact)

    async def _send(self, contact: Contact) -> None:
        reply = await self._node._try(contact, self._method, self._msg)
        stored = reply.get("stored") if isinstance(reply, dict) else None
        self._accepted[contact.public_key] = isinstance(stored, list) and len(stored) == 1 and stored[0] is None
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, contacts: list[Contact], enough: int) -> int:
        """How many of ``contacts`` (all sent to) accepted, once ``enough`` did or all answered."""
        while True:
            changed = self._changed
            outcomes = [self._accepted[c.public_key] for c in contacts]
            accepted = outcomes.count(True)
            if accepted >= enough or None not in outcomes:
                return accepted
            await changed.wait()


@dataclass
class DhtConfig:
    k: int = 20  # bucket size and replication factor
    alpha: int = 3  # queries in flight per lookup
    beta: int = 3  # a lookup ends when this many of the nearest nodes it knows have answered
    request_timeout: float = 3.0  # seconds per query
    slow_factor: float = 4.0  # a lookup asks the next contact too after this many typical answer times
    min_slow: float = 0.05  # ... but not sooner than this (seconds)
    lookup_timeout: float = 30.0  # seconds per lookup, whatever peers do
    get_quorum: int = 4  # a get stops after this many replicas answered with a record
    put_quorum: int = 5  # a put returns once this many of the k closest stored it (the rest go on)
    recent_lookup: float = 60.0  # a put knowing fewer than k others looks for closer strangers only if
    # no lookup went through its key's bucket for this many seconds
    record_ttl: float = 24 * 3600.0
    record_republish: float = 3600.0  # stored records are pushed to the current k closest
    provider_ttl: float = 48 * 3600.0
    provider_republish: float = 22 * 3600.0
    refresh_interval: float = 3600.0  # buckets without a lookup this long get one
    self_lookup_interval: float = 600.0
    peer_rate: float = 20.0  # PUT_VALUE records and ADD_PROVIDER keys per second per peer
    peer_burst: int = 200
    max_per_prefix: int = 3  # contacts a bucket admits from one IP prefix
    ipv4_prefix: int = V4_PREFIX  # bits of an IPv4 address that make its prefix
    ipv6_prefix: int = V6_PREFIX  # ... of an IPv6 address
    check_after: float = 60.0  # a full bucket pings its oldest contact only if silent this long
    max_records: int = MAX_RECORDS  # records stored for others (the farthest evicted beyond)
    max_record_bytes: int = MAX_RECORD_BYTES  # ... and their bytes
    max_records_per_author: int = MAX_PER_AUTHOR
    max_providers_per_key: int = MAX_PROVIDERS_PER_KEY
    max_provider_keys: int = MAX_PROVIDER_KEYS  # keys with provider entries
    max_providers: int = MAX_PROVIDERS  # provider entries in all
    max_request_items: int = m.MAX_BULK  # keys, ids or records accepted in one request (at most 16 sent)
    save_delay: float = 1.0  # routing table changes are written to disk this long after
    failed_memory: float = 60.0  # seconds a node that failed a query is left out of lookups
    maintenance_interval: float = 60.0


class _Shared:
    """One running lookup that later callers for the same target wait on."""

    def __init__(self):
        self.done = trio.Event()
        self.result = None
        self.error: BaseException | None = None


class DhtNode:
    """A Kademlia node.  ``sign`` signs with the key whose public half is ``public_key``.

    ``addrs`` returns where this node can be reached; it is sent with
    requests while in server mode.  ``db`` persists the routing table, records
    and provider records (None keeps them in memory).  Background work needs
    :meth:`start` (or :meth:`run`, which also runs the timers).
    """

    def __init__(self, network: Network, public_key: bytes, sign: Callable[[bytes], bytes], *,
                 addrs: Callable[[], list[str]] = lambda: [], db: Database | None = None,
                 config: DhtConfig | None = None, server_mode: bool = True,
                 validators: Validators | None = None, wall: Callable[[], float] = time.time,
                 rng: random.Random | None = None,
                 on_lookup: Callable[[Lookup, bool], None] | None = None):
        self.config = config = config or DhtConfig()
        self.network = network
        self.public_key = public_key
        self.contact = Contact(public_key)
        self.id = self.contact.id
        self._sign = sign
        self._addrs = addrs
        self.db = db
        self.server_mode = server_mode
        self.validators = validators or Validators.default()
        self.wall = wall
        self.rng = rng or random.Random()
        self._table_changed = trio.Event()
        self.joined = trio.Event()  # a lookup may find others now (bootstrap's self-lookup is done, or nobody to join)
        self.table = RoutingTable(self.id, k=config.k, max_per_prefix=config.max_per_prefix,
                                  check_after=config.check_after,
                                  prefix_bits=(config.ipv4_prefix, config.ipv6_prefix),
                                  on_change=lambda: self._table_changed.set())
        self.records = RecordStore(db, self.id, self.validators, max_records=config.max_records,
                                   max_bytes=config.max_record_bytes,
                                   max_per_author=config.max_records_per_author)
        self.providers = ProviderStore(db, max_per_key=config.max_providers_per_key,
                                       max_keys=config.max_provider_keys, max_total=config.max_providers)
        self.put_limiter = RateLimiter(config.peer_rate, config.peer_burst)
        self.provider_limiter = RateLimiter(config.peer_rate, config.peer_burst)
        self.server = DhtServer(
            table=self.table, records=self.records, providers=self.providers,
            put_limiter=self.put_limiter, provider_limiter=self.provider_limiter,
            k=config.k, provider_ttl=config.provider_ttl, wall=wall, clock=self.clock,
            heard_from=self.heard_from, is_server=lambda: self.server_mode,
            max_items=config.max_request_items)
        self.messages_sent = 0
        self.unanswered = 0  # requests that got no answer: timed out, or the peer was unreachable
        self._on_lookup = on_lookup  # told of each finished lookup and whether lookup_timeout ended it
        self._shared: dict[tuple, _Shared] = {}
        self._provided: dict[bytes, float] = {}  # key -> when to republish (trio time)
        self._thin: dict[bytes, float] = {}  # key taken by too few nodes -> seconds until it is provided again
        self._failed: dict[bytes, float] = {}  # public key -> when it last failed a query
        self._answer_time = _Ewma()  # how long peers take to answer a lookup query (seconds)
        self._provider_addrs: dict[bytes, tuple[str, ...]] = {}  # public key -> addresses a provider entry gave
        self._nursery: trio.Nursery | None = None
        if db is not None:
            for contact in db.load_contacts():
                if contact != self.contact:
                    self.table.update(contact)
        self._restored = self.providers.keys_of(public_key)  # provided before a restart

    @staticmethod
    def clock() -> float:
        return trio.current_time()

    # --- requests from peers ------------------------------------------------------------

    async def handle(self, sender_key: bytes, method: str, msg: object) -> dict:
        """Answer a request from the peer with authenticated public key ``sender_key``."""
        return await self.server.handle(sender_key, method, msg)

    def heard_from(self, contact: Contact) -> None:
        """A server-mode peer talked to us: update the table, checking the
        liveness of an old entry if its bucket is full.  A peer that failed a
        query and now talks to us itself (restarted) is asked again at once."""
        if contact == self.contact:
            return
        self._failed.pop(contact.public_key, None)
        oldest = self.table.update(contact, self.clock())
        if oldest is not None and self._nursery is not None:
            self._nursery.start_soon(self._check_liveness, oldest)

    async def _check_liveness(self, contact: Contact) -> None:
        try:
            await self._ask(contact, PING, {})
            self.table.seen(contact, self.clock())
        except DhtError:
            self.table.failed(contact)

    # --- asking peers -------------------------------------------------------------------

    async def _ask(self, contact: Contact, method: str, msg: dict) -> dict:
        """One request with the per-request timeout; raises Unreachable or Refused."""
        if self.server_mode:
            msg = {**msg, "from": list(self._addrs())}
        self.messages_sent += 1
        try:
            with trio.move_on_after(self.config.request_timeout):
                return await self.network.call(contact, method, msg)
            raise Unreachable(f"no answer to {method} within {self.config.request_timeout} s")
        except Unreachable:
            self.unanswered += 1
            raise

    async def _lookup(self, target: bytes, method: str, msg: dict,
                      on_reply: Callable[[Lookup, Contact, dict], list[Contact]], *,
                      alpha: int | None = None,
                      not_found: Callable[[], bool] | None = None) -> Lookup:
        """Run one iterative lookup with ``alpha`` queries in flight (default: the
        config's).  ``on_reply`` checks a peer's answer (raising Refused if it is
        unusable) and returns the contacts it names.  While ``not_found()`` is true,
        a finished lookup goes on: it asks the rest of the k nearest (the Kademlia
        paper's stop rule, not go-libp2p's beta nearest: a writer with a partial
        table stored at the nearest it knew), and waits for its overdue queries
        (until each answers or fails, or the lookup's time is up): they may be
        slow, not dead."""
        cfg = self.config
        seeds = [c for c in self.table.closest(target, cfg.k + len(self._failed)) if self._usable(c)]
        lookup = Lookup(target, seeds[:cfg.k], k=cfg.k, alpha=alpha or cfg.alpha,
                        beta=cfg.beta, exclude=self.public_key)
        self.table.touch(target, self.clock())
        send, receive = trio.open_memory_channel(math.inf)

        async def overdue(contact: Contact) -> None:
            await trio.sleep(self.slow_after())
            lookup.slow(contact)
            send.send_nowait(None)

        async def query(contact: Contact) -> None:
            async with trio.open_nursery() as timer:
                timer.start_soon(overdue, contact)
                started = self.clock()
                try:
                    reply = await self._ask(contact, method, msg)
                    closer = on_reply(lookup, contact, reply)
                except DhtError:
                    lookup.failed(contact)
                    self.table.failed(contact)
                    self._note_failure(contact)
                else:
                    self._answer_time.observe(self.clock() - started)
                    lookup.answered(contact, [c for c in closer if c != self.contact and self._usable(c)])
                    if m.is_server(reply):
                        self.heard_from(contact)
                    else:
                        self.table.remove(contact)
                timer.cancel_scope.cancel()
            send.send_nowait(None)

        with trio.move_on_after(cfg.lookup_timeout) as budget:
            async with trio.open_nursery() as nursery:
                while True:
                    for contact in lookup.next_queries():
                        nursery.start_soon(query, contact)
                    if lookup.finished:
                        missing = not_found is not None and not_found()
                        if missing and lookup.beta < lookup.k:  # none among the beta nearest: ask all k
                            lookup.beta = lookup.k
                            continue
                        if not (missing and lookup.overdue()):
                            break
                    await receive.receive()
                nursery.cancel_scope.cancel()
        for contact in lookup.overdue():  # still silent when the lookup ended: ask others for a while
            self._note_failure(contact)
        if self._on_lookup is not None:
            self._on_lookup(lookup, budget.cancelled_caught)
        return lookup

    def slow_after(self) -> float:
        """Seconds after which a lookup's query is overdue and the next contact is
        asked too: 4 typical answer times (``slow_factor``), within
        [``min_slow``, ``request_timeout``]."""
        cfg = self.config
        typical = self._answer_time.value
        if typical is None:
            return cfg.request_timeout
        return min(cfg.request_timeout, max(cfg.min_slow, cfg.slow_factor * typical))

    def _note_failure(self, contact: Contact) -> None:
        self._failed.pop(contact.public_key, None)
        self._failed[contact.public_key] = self.clock()
        while len(self._failed) > _MAX_FAILED:
            self._failed.pop(next(iter(self._failed)))

    def _usable(self, contact: Contact) -> bool:
        """False for a node that failed a query within ``failed_memory`` seconds:
        peers go on naming a dead node until they notice themselves."""
        when = self._failed.get(contact.public_key)
        return when is None or self.clock() - when >= self.config.failed_memory

    async def _once(self, key: tuple, run: Callable[[], Awaitable]):
        """Run ``run()``, or wait for the identical run already going and share its result."""
        shared = self._shared.get(key)
        if shared is not None:
            await shared.done.wait()
            if shared.error is not None:
                raise shared.error
            return shared.result
        shared = self._shared[key] = _Shared()
        try:
            shared.result = await run()
            return shared.result
        except DhtError as exc:
            shared.error = exc
            raise
        except BaseException:
            shared.error = Unreachable("the lookup this one shared was cancelled")
            raise
        finally:
            del self._shared[key]
            shared.done.set()

    # --- finding nodes ------------------------------------------------------------------

    async def lookup(self, target: bytes) -> Lookup:
        """The finished FIND_NODE lookup for the 32-byte id ``target`` (with its statistics)."""

        def on_reply(lookup: Lookup, contact: Contact, reply: dict) -> list[Contact]:
            return m.nodes(m.per_key(reply, "nodes", 1)[0])

        return await self._once((FIND_NODE, target),
                                lambda: self._lookup(target, FIND_NODE, {"ids": [target]}, on_reply))

    async def find_node(self, target: bytes) -> list[Contact]:
        """The k live nodes closest to ``target``, nearest first."""
        return (await self.lookup(target)).closest()

    async def find_peer(self, public_key: bytes) -> Contact | None:
        """The node with ``public_key`` with every address the network gives
        for it, or None if nobody knows it.

        Always asks the network (a peer that moved is still in our table at
        its old address): the nodes nearest its id report the addresses they
        have, which come first; then our own table's; last, those a provider
        entry of it gave in a provider lookup (a node that started a moment
        ago is a provider before the network has its contact).
        """
        wanted = Contact(public_key)
        reported: dict[str, None] = {}

        def on_reply(lookup: Lookup, contact: Contact, reply: dict) -> list[Contact]:
            nodes = m.nodes(m.per_key(reply, "nodes", 1)[0])
            for node in nodes:
                if node == wanted:
                    reported.update(dict.fromkeys(node.addrs))
            return nodes

        await self._lookup(wanted.id, FIND_NODE, {"ids": [wanted.id]}, on_reply)
        known = self.table.get(wanted)
        heard = self._provider_addrs.get(public_key, ())
        addrs = list(dict.fromkeys([*reported, *(known.addrs if known else ()), *heard]))[:MAX_ADDRS]
        return Contact(public_key, tuple(addrs)) if addrs else None

    async def bootstrap(self, seeds: list[Contact]) -> int:
        """Join through ``seeds``: ask each, look ourselves up, then fill the
        farther buckets.  Returns the routing table size.  :attr:`joined` is set
        once the self-lookup found anyone: lookups find others from then on, while
        the farther buckets still fill (seconds on a loaded machine)."""
        async with trio.open_nursery() as nursery:
            for seed in seeds:
                nursery.start_soon(self._greet, seed)
        await self.find_node(self.id)
        if len(self.table):
            self.joined.set()
        await self.refresh(interval=0)
        return len(self.table)

    async def _greet(self, seed: Contact) -> None:
        try:
            if m.is_server(await self._ask(seed, PING, {})):
                self.heard_from(seed)
        except DhtError as exc:
            log.debug("bootstrap peer %s did not answer: %s", seed.id.hex()[:12], exc)

    async def refresh(self, interval: float | None = None) -> int:
        """Look up a random id in every bucket without a lookup for ``interval``
        seconds (default: the configured refresh interval).  Returns how many ran."""
        interval = self.config.refresh_interval if interval is None else interval
        stale = self.table.stale_buckets(self.clock(), interval)
        async with trio.open_nursery() as nursery:
            for index in stale:
                nursery.start_soon(self.find_node, self.table.random_id_in_bucket(index, self.rng))
        return len(stale)

    # --- values -------------------------------------------------------------------------

    async def put(self, key: bytes, value: bytes, *, ttl: float | None = None,
                  seq: int | None = None) -> int:
        """Sign and store ``value`` under ``key`` at the k closest nodes.

        The record is on this node's disk first (and republished from here).
        Returns once ``put_quorum`` of the k closest have stored it, or all
        have answered: how many stored it by then.  While the node runs, the
        other replicas are written in the background.  A node that knows
        fewer than k others (a small mesh) stores at all it knows and returns
        once ``put_quorum`` of them took it, while its lookup goes on in the
        background to store at any closer node it finds: one round trip, not
        a lookup and then one.

        Raises RecordError when the record would be refused (unknown namespace,
        too large, another owner's key).
        """
        now = self.wall()
        local = self.records.get(key, now)
        if seq is None:
            seq = max(int(now * 1000), local.seq + 1 if local else 0)
        ttl = self.config.record_ttl if ttl is None else ttl
        record = sign_record(key, value, public_key=self.public_key, sign=self._sign,
                             seq=seq, expires=int(now + ttl))
        self.records.put(record, now)
        target, quorum = key_id(key), self.config.put_quorum
        stores = _Sends(self, PUT_VALUE, {"records": [record.to_wire()]})

        async def store_at(nursery: trio.Nursery, contacts: list[Contact]) -> int:
            # The nearest `quorum` first, alone: k stores at once would all finish late
            # (on the sending node's one thread, and the replicas' CPUs); the rest after.
            first = contacts[:quorum]
            stores.start(nursery, first)
            with trio.move_on_after(_STAGGER):
                if await stores.wait(first, quorum) == quorum:
                    stores.start(nursery, contacts)
                    return quorum
            stores.start(nursery, contacts)
            return await stores.wait(contacts, quorum)

        async def lookup_then_store(nursery: trio.Nursery) -> None:
            stores.start(nursery, await self.find_node(target))

        async def place(nursery: trio.Nursery) -> int:
            known = [c for c in self.table.closest(target, self.config.k) if self._usable(c)]
            if not known or len(self.table) >= self.config.k:
                return await store_at(nursery, await self.find_node(target))
            # Knowing fewer than k others, its k closest are all it knows: the answer unless
            # a lookup turns up strangers, which it stores at after (as libp2p's
            # optimistic provide does, the put does not wait for the lookup).  A lookup
            # through the same bucket a moment ago would have met them already.
            accepted = await store_at(nursery, known)
            if not self.table.looked_up_since(target, self.clock() - self.config.recent_lookup):
                nursery.start_soon(lookup_then_store, nursery)
            return accepted

        if self._nursery is not None:  # returns with no schedule point after the quorum: the
            return await place(self._nursery)  # caller's answer goes out before the other stores
        async with trio.open_nursery() as own:  # without a running node, wait for every store
            return await place(own)

    async def put_records(self, records: list[Record]) -> dict[bytes, int]:
        """Store signed records at the k nodes closest to each key, several
        records to one peer in one request.  Returns ``{key: replicas stored}``."""
        items = {r.key: r.to_wire() for r in records}
        return await self._replicate(items, PUT_VALUE, lambda batch: {"records": batch},
                                     lambda reply, n: sum(1 for e in m.per_key(reply, "stored", n) if e is None))

    async def get(self, key: bytes) -> Record | None:
        """The best valid record for ``key`` among those found, or None.

        Replicas that answered with an older record, and close nodes that
        answered without one, are sent the best one in the background; the
        close nodes the lookup did not ask only when some replica was behind
        (otherwise most of them hold it already).  With ``get_quorum`` 1 a
        record this node holds is the answer, without asking anyone (as
        libp2p's ``Quorum::One`` and hivemind's default get do).
        """
        now = self.wall()
        if self.config.get_quorum <= 1 and (held := self.records.get(key, now)) is not None:
            return held
        best, holders, lookup = await self._once((GET_VALUE, key), lambda: self._value_lookup(key))
        local = self.records.get(key, now)
        if best is not None and (local is None or self.validators.better(best, local)):
            try:
                self.records.put(best, now)
            except RecordError:
                pass  # our store is full of closer keys: the others still have it
        if best is not None and self._nursery is not None:
            stale = [c for c, r in holders if r is not best and self.validators.better(best, r)]
            had = {c for c, _ in holders}
            if stale:  # a replica was behind: the ones not asked may be too
                stale += [c for c in lookup.closest() if c not in had][: self.config.k - len(holders)]
            else:  # all agreed: only those asked that had none
                stale += [c for c in lookup.answered_closest() if c not in had]
            if stale:
                self._nursery.start_soon(self._send_records, stale, [best])
        return best

    async def _value_lookup(self, key: bytes):
        now = self.wall()
        found: list[tuple[Contact, Record]] = []
        local = self.records.get(key, now)
        count = 1 if local else 0

        def on_reply(lookup: Lookup, contact: Contact, reply: dict) -> list[Contact]:
            nonlocal count
            wire = m.per_key(reply, "records", 1)[0]
            nodes = m.nodes(m.per_key(reply, "nodes", 1)[0])
            if wire is not None:
                try:
                    record = Record.from_wire(wire)
                    if record.key != key:
                        raise RecordError("the record is for another key")
                    if record != local:  # a copy of ours was checked when we stored it
                        self.validators.validate(record, now)
                except RecordError as exc:
                    raise Refused(f"bad record: {exc}") from None
                found.append((contact, record))
                count += 1
                if count >= self.config.get_quorum:
                    lookup.stop()
                else:  # no more queries at once than records still needed: those asked may have them
                    lookup.alpha = min(lookup.alpha, self.config.get_quorum - count)
            return nodes

        # Enough queries in the first round to reach the quorum in one round trip; and
        # no "none" while one of the k nearest was not asked, or is only slow to answer.
        lookup = await self._lookup(key_id(key), GET_VALUE, {"keys": [key]}, on_reply,
                                    alpha=max(self.config.alpha, self.config.get_quorum - count),
                                    not_found=lambda: not count)
        candidates = ([local] if local else []) + [r for _, r in found]  # ours first: ties go to it
        best = self.validators.best(candidates) if candidates else None
        return best, found, lookup

    async def _send_records(self, contacts: list[Contact], records: list[Record]) -> None:
        batch = [r.to_wire() for r in records]
        async with trio.open_nursery() as nursery:
            for contact in contacts:
                nursery.start_soon(self._try, contact, PUT_VALUE, {"records": batch})

    async def _try(self, contact: Contact, method: str, msg: dict) -> dict | None:
        try:
            return await self._ask(contact, method, msg)
        except DhtError as exc:
            log.debug("%s to %s failed: %s", method, contact.id.hex()[:12], exc)
            return None

    # --- providers ----------------------------------------------------------------------

    async def provide(self, key: bytes) -> int:
        """Announce this node as a provider of ``key``; returns how many of the
        k closest nodes took the record.  Republished until :meth:`unprovide`."""
        return (await self.provide_many([key]))[key]

    async def provide_many(self, keys: list[bytes]) -> dict[bytes, int]:
        """:meth:`provide` for several keys, with one request per peer for all
        the keys it is close to.  The first republish of each key is spread
        uniformly over the second half of the republish interval."""
        now, clock = self.wall(), self.clock()
        interval = self.config.provider_republish
        for key in keys:
            if not isinstance(key, bytes) or not 0 < len(key) <= m.MAX_KEY:
                raise RecordError(f"a provider key must be 1 to {m.MAX_KEY} bytes")
            self.providers.add(key, self.own_contact(), now + self.config.provider_ttl, now)
            if key not in self._provided:
                self._provided[key] = clock + interval * self.rng.uniform(0.5, 1.0)
        msg_base = {"a": list(self._addrs()), "ttl": self.config.provider_ttl}
        stored = await self._replicate({k: k for k in keys}, ADD_PROVIDER,
                                       lambda batch: {**msg_base, "keys": batch},
                                       lambda reply, n: n if reply.get("added") == n else 0)
        self._retry_thin(stored)
        return stored

    def _retry_thin(self, stored: dict[bytes, int]) -> None:
        """Bring the republish of keys fewer than ``put_quorum`` nodes took forward.

        A node that provides right after it joined knows few nodes, so its
        record lands on few, perhaps not the closest (lookups then miss it
        until the republish, hours later).  Such a key is provided again after
        the maintenance interval, then twice that, and so on, until enough
        nodes take it or the normal interval comes first."""
        clock, enough = self.clock(), min(self.config.put_quorum, self.config.k)
        for key, count in stored.items():
            if key not in self._provided:  # unprovided meanwhile
                self._thin.pop(key, None)
            elif count >= enough:
                self._thin.pop(key, None)
            else:
                wait = self._thin[key] = 2 * self._thin.get(key, self.config.maintenance_interval / 2)
                self._provided[key] = min(self._provided[key], clock + wait)

    def unprovide(self, key: bytes) -> None:
        """Stop republishing ``key``; the records elsewhere expire on their own."""
        self._provided.pop(key, None)
        self._thin.pop(key, None)

    async def find_providers(self, key: bytes, count: int = 20) -> list[Contact]:
        """Up to ``count`` providers of ``key`` (this node first if it is one)."""
        return await self._once((GET_PROVIDERS, key, count), lambda: self._provider_lookup(key, count))

    async def _provider_lookup(self, key: bytes, count: int) -> list[Contact]:
        now = self.wall()
        found: dict[Contact, None] = dict.fromkeys(c for c, _ in self.providers.get(key, now))

        def on_reply(lookup: Lookup, contact: Contact, reply: dict) -> list[Contact]:
            entries = m.per_key(reply, "providers", 1)[0]
            if not isinstance(entries, list) or len(entries) > m.MAX_PROVIDERS:
                raise Refused("bad provider list")
            for entry in entries:  # contacts with an "exp" beside them
                found.setdefault(m.contact(entry), None)
            if len(found) >= count:
                lookup.stop()
            return m.nodes(m.per_key(reply, "nodes", 1)[0])

        await self._lookup(key_id(key), GET_PROVIDERS, {"keys": [key]}, on_reply)
        for contact in found:
            if contact.addrs:
                self._provider_addrs.pop(contact.public_key, None)  # the newest last
                self._provider_addrs[contact.public_key] = contact.addrs[:MAX_ADDRS]
        while len(self._provider_addrs) > MAX_PROVIDER_ADDRS:
            del self._provider_addrs[next(iter(self._provider_addrs))]
        return list(found)[:count]

    def own_contact(self) -> Contact:
        return Contact(self.public_key, tuple(self._addrs()))

    # --- storing at the k closest -------------------------------------------------------

    async def _replicate(self, items: dict[bytes, object], method: str,
                         make_msg: Callable[[list], dict],
                         count_ok: Callable[[dict, int], int]) -> dict[bytes, int]:
        """Find the k closest nodes to each key, then send each node the items
        it should hold, at most MAX_BULK (or ``max_request_items``, if fewer) per request.  ``count_ok(reply, n)``
        says how many of the n items in a request were accepted; the result
        is how many nodes accepted each key's item (not counting this one)."""
        closest: dict[bytes, list[Contact]] = {}

        async def find(key: bytes) -> None:
            closest[key] = await self.find_node(key_id(key))

        async with trio.open_nursery() as nursery:
            for key in items:
                nursery.start_soon(find, key)
        per_peer: dict[Contact, list[bytes]] = {}
        for key, contacts in closest.items():
            for contact in contacts:
                per_peer.setdefault(contact, []).append(key)
        stored = dict.fromkeys(items, 0)

        async def send(contact: Contact, keys: list[bytes]) -> None:
            reply = await self._try(contact, method, make_msg([items[k] for k in keys]))
            try:
                accepted = count_ok(reply, len(keys)) if reply is not None else 0
            except Refused:
                accepted = 0
            if accepted == len(keys):
                for key in keys:
                    stored[key] += 1

        async with trio.open_nursery() as nursery:
            bulk = min(m.MAX_BULK, self.config.max_request_items)  # what every peer accepts by default
            for contact, keys in per_peer.items():
                for start in range(0, len(keys), bulk):
                    nursery.start_soon(send, contact, keys[start:start + bulk])
        return stored

    # --- background work ----------------------------------------------------------------

    def start(self, nursery: trio.Nursery) -> None:
        """Let the node run background tasks (liveness checks, replica repair) in ``nursery``."""
        self._nursery = nursery

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the node's timers until cancelled: bucket refresh, self-lookup,
        republishing, expiry, and saving the routing table.  Saves on exit."""
        interval = self.config.provider_republish
        for key in self._restored:
            self._provided.setdefault(key, self.clock() + interval * self.rng.uniform(0.5, 1.0))
        async with trio.open_nursery() as nursery:
            self.start(nursery)
            nursery.start_soon(self._save_loop)
            task_status.started()
            try:
                await self._maintenance_loop()
            finally:
                self.save()

    async def _maintenance_loop(self) -> None:
        cfg = self.config
        next_self = next_records = self.clock()
        while True:
            await trio.sleep(cfg.maintenance_interval * self.rng.uniform(0.9, 1.1))
            now, clock = self.wall(), self.clock()
            self.records.expire(now)
            self.providers.expire(now)
            if clock >= next_self:
                next_self = clock + cfg.self_lookup_interval
                await self.find_node(self.id)
            await self.refresh()
            await self._republish_providers(clock)
            if clock >= next_records:
                next_records = clock + cfg.record_republish
                await self.put_records(list(self.records.records()))

    async def _republish_providers(self, clock: float) -> None:
        due = [key for key, when in self._provided.items() if when <= clock]
        for key in due:
            self._provided[key] = clock + self.config.provider_republish
        for start in range(0, len(due), 256):
            await self.provide_many(due[start:start + 256])

    async def _save_loop(self) -> None:
        if self.db is None:
            return
        while True:
            await self._table_changed.wait()
            self._table_changed = trio.Event()
            await trio.sleep(self.config.save_delay)  # batch a burst of changes into one write
            self.save()

    def save(self) -> None:
        """Write the routing table to the database (a no-op without one)."""
        if self.db is not None:
            self.db.save_contacts(self.table.contacts())

    def routing_info(self) -> dict:
        """The routing table for display: size, buckets, and every contact."""
        return {
            "id": self.id.hex(),
            "mode": "server" if self.server_mode else "client",
            "size": len(self.table),
            "buckets": {str(i): list(sizes) for i, sizes in self.table.bucket_sizes().items()},
            "contacts": [{"public_key": c.public_key.hex(), "addrs": list(c.addrs),
                          "bucket": self.table.bucket_of(c)} for c in self.table.contacts()],
            "records": len(self.records),
            "providing": len(self._provided),
        }
