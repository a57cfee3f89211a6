"""The Kademlia DHT (:mod:`dht`) served and used over meshd RPC.

:class:`Dht` holds a node's :class:`~dht.node.DhtNode`: its requests travel
as unary RPC calls (``dht.find_node``, ...) over the one connection to each
peer, its answers are RPC handlers, and its records, providers and routing
table live in ``DATA_DIR/dht.sqlite``.  It runs the DHT's timers, keeps its
server/client role in step with AutoNAT and joins the network through the
bootstrap peers.

The sender of every request is the PeerId the connection authenticated,
never anything the message says.
"""

from __future__ import annotations

import logging
import random
from typing import Protocol

import trio

from dht.ids import Contact
from dht.lookup import Lookup
from dht.network import METHODS, DhtError, RateLimited, Refused, Unreachable
from dht.node import DhtNode
from dht.storage import Database

from ...histogram import Histogram
from ...identity import PeerId
from ...rpc import (Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted, RpcError,
                    Unavailable)
from ...service import Host
from .config import DhtSection
from .control import control_methods
from .relays import RelayRecords, Relays

log = logging.getLogger("meshd.dht")

DB_FILE = "dht.sqlite"
AUTONAT_WAIT = 120.0  # seconds "auto" mode waits for a first AutoNAT verdict before joining
_UNREACHABLE = (Unavailable, DeadlineExceeded, Cancelled)
HOP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 15, 20)


class RpcNetwork:
    """:class:`dht.network.Network` over a node's RPC: one unary call per request."""

    def __init__(self, host: Host, timeout: float):
        self._host = host
        self._timeout = timeout

    async def call(self, contact: Contact, method: str, msg: dict) -> dict:
        """Call ``method`` on the contact's node, connecting first if needed.

        The contact's addresses are dialed after those the peer store already
        has (only an address that answered with the right key is stored).
        Raises Unreachable when the peer cannot be reached or does not answer
        in time, Refused when it answers with any other error or a non-map.
        """
        peer = PeerId(contact.public_key)
        try:
            await self._host.connection(peer, hints=contact.addrs, find=False)
            reply = await self._host.rpc.call(peer, method, msg, timeout=self._timeout)
        except _UNREACHABLE as exc:
            raise Unreachable(f"{method} to {peer.short()}: {exc}") from None
        except RpcError as exc:
            raise Refused(f"{method} to {peer.short()}: {exc}") from None
        if not isinstance(reply, dict):
            raise Refused(f"{method} to {peer.short()}: the reply is not a map")
        return reply


class Reachability(Protocol):
    """What the DHT reads of AutoNAT ("auto" mode): the verdict, and its changes."""

    status: str  # "public", "private" or "unknown"
    changed: trio.lowlevel.ParkingLot  # unparked whenever the status changes
    settled: trio.Event  # the first round of checks is over


class Dht:
    """The node's DHT (service ``dht``, config ``[dht]``): a :class:`~dht.node.DhtNode`
    whose state lives in ``DATA_DIR/dht.sqlite``.

    ``reachability`` (AutoNAT) sets the role in "auto" mode; with
    ``wait_for_verdict`` the node joins only after AutoNAT's first verdict
    (or ``AUTONAT_WAIT`` seconds).  Other services use :attr:`node` for
    provider records and lookups; it also tells the node where peers are.
    """

    name = "dht"

    def __init__(self, host: Host, config: DhtSection, *, backoff_cap: float,
                 reachability: Reachability | None = None, wait_for_verdict: bool = False,
                 relays: Relays | None = None):
        self._host = host
        self.config = config
        self._backoff_cap = backoff_cap
        self._reachability = reachability
        self._wait_for_verdict = wait_for_verdict
        lib_config = config.dht_config()
        self.db = Database(host.data_dir / DB_FILE)
        self._hops = Histogram(HOP_BUCKETS)
        self._lookup_timeouts = 0
        self.node = DhtNode(RpcNetwork(host, lib_config.request_timeout), host.peer_id.key, host.identity.sign,
                            addrs=host.advertised_addresses, db=self.db, config=lib_config,
                            server_mode=self._wants_server(), on_lookup=self._lookup_done)
        self._relay_records = None if relays is None else \
            RelayRecords(host, self.node, relays, check=config.relays_check)
        host.add_lookup(self._addresses_of)

    def rpc_methods(self) -> dict:
        return {method: _handler(self.node, method) for method in METHODS}

    def control_methods(self) -> dict:
        return control_methods(self.node, self._host.peer_id)

    def status(self) -> dict:
        info = self.node.routing_info()
        return {"mode": info["mode"], "contacts": info["size"], "records": info["records"],
                "providing": info["providing"]}

    def figures(self) -> dict:
        """For the metrics service: the table's and stores' sizes, lookups (with the
        hops each took), lookups ended by ``lookup_timeout``, queries that got no answer."""
        return {"contacts": len(self.node.table), "records": len(self.node.records),
                "lookups_total": self._hops.count, "lookup_hops": self._hops.snapshot(),
                "lookup_timeouts_total": self._lookup_timeouts,
                "unanswered_queries_total": self.node.unanswered}

    def _lookup_done(self, lookup: Lookup, timed_out: bool) -> None:
        self._hops.observe(lookup.hops())
        self._lookup_timeouts += timed_out

    def close(self) -> None:
        self.db.close()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the DHT until cancelled: its timers, its role, and joining the network."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.node.run)
            if self.config.mode == "auto" and self._reachability is not None:
                nursery.start_soon(self._follow_reachability)
            nursery.start_soon(self._join)
            if self._relay_records is not None:
                nursery.start_soon(self._relay_records.keep_published)
            task_status.started()

    async def _addresses_of(self, peer: PeerId, errors: dict[str, str]) -> tuple[str, ...]:
        """The addresses the DHT has for ``peer`` (asks the network); if it has none,
        a connection through a relay the peer published (see relays.py) may be
        opened instead."""
        try:
            contact = await self.node.find_peer(peer.key)
        except DhtError as exc:
            log.debug("DHT lookup of %s failed: %s", peer, exc)
            contact = None
        if contact is not None and contact.addrs:
            return contact.addrs
        if self._relay_records is not None:
            await self._relay_records.reach(peer, errors)
        return ()

    def _wants_server(self) -> bool:
        """The configured role; "auto" is a server unless AutoNAT found that
        strangers cannot reach us."""
        mode = self.config.mode
        if mode != "auto":
            return mode == "server"
        return self._reachability is None or self._reachability.status != "private"

    async def _follow_reachability(self) -> None:
        """Keep the DHT's role in step with the AutoNAT verdict ("auto" mode)."""
        while True:
            server = self._wants_server()
            if server != self.node.server_mode:
                self.node.server_mode = server
                log.info("DHT %s mode: AutoNAT says %s", "server" if server else "client",
                         self._reachability.status)
            await self._reachability.changed.park()

    async def _join(self) -> None:
        """Join through the bootstrap peers and the routing table saved last time
        (without a saved table, once a bootstrap peer is connected); retry with
        backoff while the table is empty."""
        host = self._host
        seeds = [Contact(addr.peer_id.key, (str(addr.hostport),))
                 for addr in host.bootstrap if addr.peer_id != host.peer_id]
        if not seeds and not len(self.node.table):
            self.node.joined.set()  # nothing to wait for (not AutoNAT's verdict either)
            return  # the first node of a network: others join through it
        if self.config.mode == "auto" and self._wait_for_verdict:
            # Lookups send to many peers, and a peer we sent to cannot be AutoNAT's
            # independent dial-back: let the first verdict come first.
            if not self._reachability.settled.is_set():
                log.info("DHT: joining after AutoNAT's first verdict (at most %.0f s)", AUTONAT_WAIT)
            with trio.move_on_after(AUTONAT_WAIT):
                await self._reachability.settled.wait()
        delay = 0.5
        while True:
            if seeds and not len(self.node.table):
                await _any_connected(host, [PeerId(seed.public_key) for seed in seeds])
            size = await self.node.bootstrap(seeds)
            if size:
                log.info("joined the DHT: %d contacts in the routing table", size)
                return
            log.warning("DHT bootstrap found no peers (retry in %.1f s)", delay)
            await trio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(self._backoff_cap, delay * 2)


def _handler(dht: DhtNode, method: str):
    async def handle(arg: object, ctx) -> dict:
        """Answer a DHT request from the connection's authenticated peer."""
        try:
            return await dht.handle(ctx.peer.key, method, arg)
        except Refused as exc:
            raise (ResourceExhausted if isinstance(exc, RateLimited) else InvalidArgument)(str(exc)) from None

    return handle


async def _any_connected(host: Host, peers: list[PeerId]) -> None:
    """Return once a connection to one of ``peers`` is up."""
    async with trio.open_nursery() as nursery:
        async def wait(peer: PeerId) -> None:
            await host.wait_connected(peer)
            nursery.cancel_scope.cancel()

        for peer in peers:
            nursery.start_soon(wait, peer)
