"""Where a node's relays are, kept in the DHT for peers that never met it.

A node behind a NAT is reached through the relays that hold its reservation
(docs/nat.md).  Peers it met learn them from ``identify``, and a node tries
its own bootstrap peers as relays; anyone else, with another bootstrap
peer, could not reach it by PeerId.  So while a node holds reservations it
keeps a record ``/owned/<its key hex>/relays`` in the DHT: the relays'
``PEERID@HOST:PORT``, signed by the node (only it may write that key).  A
dial that found no address for a peer (its DHT lookup included) reads the
record and connects through one of those relays.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from dht.network import DhtError
from dht.node import DhtNode
from dht.records import RecordError

from ...address import AddressError, PeerAddr
from ...identity import PeerId
from ...rpc import RpcError
from ...service import Host
from ...transport import PeerConnection
from ...wire import FrameError, pack, unpack

log = logging.getLogger("meshd.dht")

MAX_RELAYS = 8  # relays published, and read from a peer's record
RECORD_TTL = 2 * 3600.0  # seconds a published record lives; it is published again at half that


class Relays(Protocol):
    """What the DHT reads of the NAT service: where our reservations are, and how to
    go through a relay."""

    def relay_addresses(self) -> list[str]:
        """``PEERID@HOST:PORT`` of each relay holding our reservation now."""

    async def via(self, hop: PeerId, peer: PeerId) -> PeerConnection:
        """A connection to ``peer`` through the relay ``hop`` (connected); raises an RpcError."""


def relays_key(peer: PeerId) -> bytes:
    """The DHT key of ``peer``'s relays record."""
    return b"/owned/" + peer.key.hex().encode() + b"/relays"


def decode_relays(value: bytes) -> list[PeerAddr]:
    """The relays a record names: at most ``MAX_RELAYS``, entries that do not parse
    skipped; none for a value that is not a msgpack list."""
    try:
        items = unpack(value)
    except FrameError:
        return []
    found = []
    for item in items[:MAX_RELAYS] if isinstance(items, list) else []:
        try:
            found.append(PeerAddr.parse(item))
        except (AddressError, AttributeError, TypeError):  # not an address, or not text
            continue
    return found


class RelayRecords:
    """Publishes this node's relays record and reaches peers through theirs."""

    def __init__(self, host: Host, node: DhtNode, relays: Relays, *, check: float):
        self._host = host
        self._node = node
        self._relays = relays
        self._check = check

    async def keep_published(self) -> None:
        """Every ``check`` seconds, publish our relays if they changed since the last
        publication (an empty list once we hold none, if some were published), or if
        that publication is half-way to its expiry.  A put that fails is tried again
        at the next look."""
        key = relays_key(self._host.peer_id)
        published: list[str] = []
        due = 0.0
        while True:
            relays = sorted(self._relays.relay_addresses())[:MAX_RELAYS]
            now = trio.current_time()
            if relays != published or (relays and now >= due):
                try:
                    stored = await self._node.put(key, pack(relays), ttl=RECORD_TTL)
                except (DhtError, RecordError) as exc:
                    log.debug("relays not published: %s", exc)
                else:
                    if stored:
                        published, due = relays, now + RECORD_TTL / 2
            await trio.sleep(self._check)

    async def reach(self, peer: PeerId, errors: dict[str, str]) -> PeerConnection | None:
        """A connection to ``peer`` through a relay its record names, or None: each
        relay is dialed at the address the record gives (a relay must answer with
        its PeerId there), then asked for a circuit, until one works.  Each failure
        goes in ``errors``."""
        try:
            record = await self._node.get(relays_key(peer))
        except DhtError as exc:
            log.debug("no relays record of %s: %s", peer.short(), exc)
            return None
        for relay in decode_relays(record.value) if record is not None else []:
            if relay.peer_id in (peer, self._host.peer_id):
                continue
            try:
                await self._host.connection(relay.peer_id, hints=[str(relay.hostport)], find=False)
                return await self._relays.via(relay.peer_id, peer)
            except RpcError as exc:
                label = f"via {relay.peer_id.short()} (its DHT record)"
                errors[label] = f"{label}: {exc.message}"
        return None
