"""Answering DHT requests from peers.

The sender's public key comes from the authenticated connection, never from
the message, so a peer can only add itself as a provider.  A sender that
gives addresses in ``from`` is in server mode and may enter the routing
table; one that does not is a client and is only answered.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from . import messages as m
from .ids import Contact, key_id
from .network import (ADD_PROVIDER, FIND_NODE, GET_PROVIDERS, GET_VALUE, PING, PUT_VALUE,
                      RateLimited, Refused)
from .ratelimit import RateLimiter
from .records import Record, RecordError
from .routing import RoutingTable
from .storage import ProviderStore, RecordStore


class DhtServer:
    """The six DHT methods, answered from a node's routing table and stores.

    It is given exactly what it reads and keeps no state of its own:
    ``table``, ``records`` and ``providers`` are the node's; each peer's
    PUT_VALUE records are charged to ``put_limiter`` and its ADD_PROVIDER keys
    to ``provider_limiter``.  A reply names the ``k`` closest contacts, and a
    provider record is kept at most ``provider_ttl`` seconds.  ``wall()`` is
    Unix time (record expiry), ``clock()`` trio time (rate limits);
    ``heard_from(contact)`` is told of every sender in server mode, and
    ``is_server()`` says whether this node answers as a server.  A request
    naming more than ``max_items`` keys, ids or records is refused.
    """

    def __init__(self, *, table: RoutingTable, records: RecordStore, providers: ProviderStore,
                 put_limiter: RateLimiter, provider_limiter: RateLimiter, k: int,
                 provider_ttl: float, wall: Callable[[], float], clock: Callable[[], float],
                 heard_from: Callable[[Contact], None], is_server: Callable[[], bool],
                 max_items: int = m.MAX_BULK):
        self._table = table
        self._records = records
        self._providers = providers
        self._put_limiter = put_limiter
        self._provider_limiter = provider_limiter
        self._k = k
        self._provider_ttl = provider_ttl
        self._wall = wall
        self._clock = clock
        self._heard_from = heard_from
        self._is_server = is_server
        self._max_items = max_items
        self._handlers: dict[str, Callable[[Contact, dict], Awaitable[dict]]] = {
            PING: self._ping,
            FIND_NODE: self._find_node,
            GET_VALUE: self._get_value,
            PUT_VALUE: self._put_value,
            ADD_PROVIDER: self._add_provider,
            GET_PROVIDERS: self._get_providers,
        }

    async def handle(self, sender_key: bytes, method: str, msg: object) -> dict:
        """Answer ``msg`` from the peer whose authenticated key is ``sender_key``.

        Raises Refused for an unknown method or a malformed or over-limit request.
        """
        handler = self._handlers.get(method)
        if handler is None:
            raise Refused(f"unknown DHT method {method!r}")
        if not isinstance(msg, dict):
            raise Refused("a DHT request must be a map")
        addrs = m.sender_addrs(msg)
        sender = Contact(sender_key, addrs or ())
        if addrs:
            self._heard_from(sender)
        reply = await handler(sender, msg)
        reply["server"] = self._is_server()
        return reply

    def _closest(self, target: bytes) -> list[dict]:
        return [c.to_wire() for c in self._table.closest(target, self._k)]

    async def _ping(self, sender: Contact, msg: dict) -> dict:
        return {}

    async def _find_node(self, sender: Contact, msg: dict) -> dict:
        return {"nodes": [self._closest(target) for target in m.ids(msg, self._max_items)]}

    async def _get_value(self, sender: Contact, msg: dict) -> dict:
        now = self._wall()
        records, nodes = [], []
        for key in m.keys(msg, self._max_items):
            record = self._records.get(key, now)
            records.append(record.to_wire() if record else None)
            nodes.append(self._closest(key_id(key)))
        return {"records": records, "nodes": nodes}

    async def _put_value(self, sender: Contact, msg: dict) -> dict:
        items = m.field_list(msg, "records", self._max_items)
        self._charge(self._put_limiter, sender, len(items), "PUT_VALUE")
        now = self._wall()
        results = []
        for item in items:
            try:
                self._records.put(Record.from_wire(item), now)
                results.append(None)
            except RecordError as exc:
                results.append(str(exc))
        return {"stored": results}

    async def _add_provider(self, sender: Contact, msg: dict) -> dict:
        keys = m.keys(msg, self._max_items)
        self._charge(self._provider_limiter, sender, len(keys), "ADD_PROVIDER")
        addrs = m.addrs(msg.get("a", []), "a")
        ttl = msg.get("ttl")
        if not isinstance(ttl, (int, float)) or ttl <= 0:
            raise Refused("'ttl' must be a positive number of seconds")
        now = self._wall()
        expires = now + min(float(ttl), self._provider_ttl)
        provider = Contact(sender.public_key, addrs)
        try:
            for key in keys:
                self._providers.add(key, provider, expires, now)
        except RecordError as exc:
            raise Refused(str(exc)) from None
        return {"added": len(keys)}

    async def _get_providers(self, sender: Contact, msg: dict) -> dict:
        now = self._wall()
        found, nodes = [], []
        for key in m.keys(msg, self._max_items):
            entries = self._providers.get(key, now)[: m.MAX_PROVIDERS]
            found.append([{**c.to_wire(), "exp": exp} for c, exp in entries])
            nodes.append(self._closest(key_id(key)))
        return {"providers": found, "nodes": nodes}

    def _charge(self, limiter: RateLimiter, sender: Contact, cost: int, what: str) -> None:
        if not limiter.allow(sender.public_key, self._clock(), cost):
            raise RateLimited(f"too many {what} requests from this peer; slow down")
