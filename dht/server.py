"""Answering DHT requests from peers.

The sender's public key comes from the authenticated connection, never from
the message, so a peer can only add itself as a provider.  A sender that
gives addresses in ``from`` is in server mode and may enter the routing
table; one that does not is a client and is only answered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

from . import messages as m
from .ids import Contact, key_id
from .network import (ADD_PROVIDER, FIND_NODE, GET_PROVIDERS, GET_VALUE, PING, PUT_VALUE,
                      RateLimited, Refused)
from .records import Record, RecordError

if TYPE_CHECKING:
    from .node import DhtNode


class DhtServer:
    """The six DHT methods, answered from a :class:`~dht.node.DhtNode`'s state."""

    def __init__(self, node: "DhtNode"):
        self.node = node
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
            self.node.heard_from(sender)
        reply = await handler(sender, msg)
        reply["server"] = self.node.server_mode
        return reply

    def _closest(self, target: bytes) -> list[dict]:
        return [c.to_wire() for c in self.node.table.closest(target, self.node.config.k)]

    async def _ping(self, sender: Contact, msg: dict) -> dict:
        return {}

    async def _find_node(self, sender: Contact, msg: dict) -> dict:
        return {"nodes": [self._closest(target) for target in m.ids(msg)]}

    async def _get_value(self, sender: Contact, msg: dict) -> dict:
        now = self.node.wall()
        records, nodes = [], []
        for key in m.keys(msg):
            record = self.node.records.get(key, now)
            records.append(record.to_wire() if record else None)
            nodes.append(self._closest(key_id(key)))
        return {"records": records, "nodes": nodes}

    async def _put_value(self, sender: Contact, msg: dict) -> dict:
        items = m.field_list(msg, "records", m.MAX_BULK)
        self._charge(self.node.put_limiter, sender, len(items), "PUT_VALUE")
        now = self.node.wall()
        results = []
        for item in items:
            try:
                self.node.records.put(Record.from_wire(item), now)
                results.append(None)
            except RecordError as exc:
                results.append(str(exc))
        return {"stored": results}

    async def _add_provider(self, sender: Contact, msg: dict) -> dict:
        keys = m.keys(msg)
        self._charge(self.node.provider_limiter, sender, len(keys), "ADD_PROVIDER")
        addrs = m.addrs(msg.get("a", []), "a")
        ttl = msg.get("ttl")
        if not isinstance(ttl, (int, float)) or ttl <= 0:
            raise Refused("'ttl' must be a positive number of seconds")
        now = self.node.wall()
        expires = now + min(float(ttl), self.node.config.provider_ttl)
        provider = Contact(sender.public_key, addrs)
        try:
            for key in keys:
                self.node.providers.add(key, provider, expires, now)
        except RecordError as exc:
            raise Refused(str(exc)) from None
        return {"added": len(keys)}

    async def _get_providers(self, sender: Contact, msg: dict) -> dict:
        now = self.node.wall()
        found, nodes = [], []
        for key in m.keys(msg):
            entries = self.node.providers.get(key, now)[: m.MAX_PROVIDERS]
            found.append([{**c.to_wire(), "exp": exp} for c, exp in entries])
            nodes.append(self._closest(key_id(key)))
        return {"providers": found, "nodes": nodes}

    def _charge(self, limiter, sender: Contact, cost: int, what: str) -> None:
        if not limiter.allow(sender.public_key, self.node.clock(), cost):
            raise RateLimited(f"too many {what} requests from this peer; slow down")
