"""A stand-in for the node core in services' unit tests.

:class:`FakeHost` implements :class:`meshd.service.Host` with no socket: a
real identity and data directory, a real :class:`~meshd.rpc.peer.PeerRpc`
registry whose calls fail with Unavailable (there is no network), and lists
that record what a service registered with the host (lookups, routes,
address sources, identify fields, protected peers).  :class:`FakeProviders`
is an in-memory DHT provider table for the services that need one.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import trio

from dht.ids import Contact
from dht.records import Record, sign_record
from dht.validators import Validators
from meshd.address import HostPort, PeerAddr
from meshd.identity import Identity, PeerId
from meshd.rpc import Unavailable
from meshd.rpc.peer import PeerRpc, RpcConfig


class FakeEndpoint:
    """What the nat service touches of an endpoint: the STUN hook, datagrams, stats."""

    def __init__(self) -> None:
        self.stun_hook = None
        self.sent: list[tuple[bytes, tuple]] = []
        self.stats: Counter = Counter()

    def send_datagram(self, data: bytes, address: tuple) -> None:
        self.sent.append((data, address))


class FakeHost:
    """A node core with no network: every dial fails with Unavailable."""

    def __init__(self, data_dir: Path, *, bootstrap: list[PeerAddr] | None = None):
        self.identity = Identity.generate()
        self.peer_id = self.identity.peer_id
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.endpoint = FakeEndpoint()
        self.bootstrap = bootstrap or []
        self.rpc = PeerRpc(self.connection, RpcConfig())
        self.lookups: list = []
        self.routes: list = []
        self.address_sources: list = []
        self.identify_fields: list = []
        self.protected: list = []
        self.farewells: list = []
        self.spawned: list = []
        self.dialed: list[PeerId] = []

    @property
    def listen_address(self) -> HostPort:
        return HostPort("127.0.0.1", 4001)

    def spawn(self, fn, *args) -> None:
        self.spawned.append((fn, args))

    def live(self, peer: PeerId):
        return None

    def connected(self) -> list[PeerId]:
        return []

    async def connection(self, peer: PeerId, *, hints=(), find: bool = True):
        self.dialed.append(peer)
        await trio.lowlevel.checkpoint()
        raise Unavailable(f"{peer.short()}: the fake host has no network")

    async def wait_connected(self, peer: PeerId) -> None:
        await trio.sleep_forever()

    async def wait_connection_change(self, peer: PeerId) -> None:
        await trio.sleep_forever()

    def recently_connected(self, address: tuple[str, int]) -> bool:
        return False

    def advertised_addresses(self) -> list[str]:
        return [str(a) for source in self.address_sources for a in source()]

    def add_lookup(self, lookup) -> None:
        self.lookups.append(lookup)

    def add_route(self, route) -> None:
        self.routes.append(route)

    def add_address_source(self, source) -> None:
        self.address_sources.append(source)

    def add_identify(self, fields) -> None:
        self.identify_fields.append(fields)

    def protect(self, peers) -> None:
        self.protected.append(peers)

    def add_farewell(self, goodbye) -> None:
        self.farewells.append(goodbye)


class FakeProviders:
    """Provider records in one dict: ``provide`` adds this host, ``find_providers`` reads them."""

    def __init__(self, me: PeerId):
        self._me = Contact(me.key, ())
        self.records: dict[bytes, list[Contact]] = {}
        self.changed = trio.Event()
        self.joined = trio.Event()
        self.joined.set()  # one dict: nothing to join

    async def provide(self, key: bytes) -> int:
        await trio.lowlevel.checkpoint()
        holders = self.records.setdefault(key, [])
        if self._me not in holders:
            holders.append(self._me)
        self.changed.set()
        return 1

    def unprovide(self, key: bytes) -> None:
        self.records.pop(key, None)
        self.changed.set()

    async def find_providers(self, key: bytes, count: int) -> list[Contact]:
        await trio.lowlevel.checkpoint()
        return self.records.get(key, [])[:count]

    async def wait_for(self, key: bytes) -> None:
        """Return once ``key`` has a provider record."""
        while key not in self.records:
            self.changed = trio.Event()
            await self.changed.wait()


class FakeRecords:
    """Signed records in one dict that any number of fake hosts may share, as
    one replica: ``put`` signs with this host's identity and keeps the record
    only if the real validators admit it and find it better than the one held."""

    def __init__(self, identity: Identity, store: dict[bytes, Record] | None = None):
        self._identity = identity
        self.store: dict[bytes, Record] = {} if store is None else store
        self._validators = Validators.default()

    async def put(self, key: bytes, value: bytes, *, ttl: float | None = None) -> int:
        await trio.lowlevel.checkpoint()
        now, current = time.time(), self.store.get(key)
        seq = max(int(now * 1000), current.seq + 1 if current else 0)
        record = sign_record(key, value, public_key=self._identity.peer_id.key, sign=self._identity.sign,
                             seq=seq, expires=int(now + (ttl or 3600)))
        self._validators.validate(record, now)
        if current is not None and not self._validators.better(record, current):
            return 0
        self.store[key] = record
        return 1

    async def get(self, key: bytes) -> Record | None:
        await trio.lowlevel.checkpoint()
        return self.store.get(key)
