"""The Kademlia DHT (:mod:`dht`) served and used over meshd RPC.

:func:`create_dht` builds a node's :class:`~dht.node.DhtNode`: its requests
travel as unary RPC calls (``dht.find_node``, ...) over the one connection to
each peer, its answers are RPC handlers, and its records, providers and
routing table live in ``DATA_DIR/dht.sqlite``.  :func:`run_dht` runs its
timers, keeps its server/client role in step with AutoNAT and joins the
network through the bootstrap peers.

The sender of every request is the PeerId the connection authenticated,
never anything the message says.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import trio

from dht.ids import Contact
from dht.network import METHODS, RateLimited, Refused, Unreachable
from dht.node import DhtNode
from dht.storage import Database

from .identity import PeerId
from .rpc import (Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted, RpcError,
                  Unavailable)

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger("meshd.dht")

DB_FILE = "dht.sqlite"
AUTONAT_WAIT = 120.0  # seconds "auto" mode waits for a first AutoNAT verdict before joining
_UNREACHABLE = (Unavailable, DeadlineExceeded, Cancelled)


class RpcNetwork:
    """:class:`dht.network.Network` over a node's RPC: one unary call per request."""

    def __init__(self, node: "Node", timeout: float):
        self._node = node
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
            await self._node.connection(peer, hints=contact.addrs, find=False)
            reply = await self._node.rpc.call(peer, method, msg, timeout=self._timeout)
        except _UNREACHABLE as exc:
            raise Unreachable(f"{method} to {peer.short()}: {exc}") from None
        except RpcError as exc:
            raise Refused(f"{method} to {peer.short()}: {exc}") from None
        if not isinstance(reply, dict):
            raise Refused(f"{method} to {peer.short()}: the reply is not a map")
        return reply


def create_dht(node: "Node") -> DhtNode:
    """The node's DHT, with its state loaded from ``DATA_DIR/dht.sqlite`` and
    its methods registered on ``node.rpc``.  Close ``dht.db`` when done."""
    config = node.config.dht.dht_config()
    db = Database(node.data_dir / DB_FILE)
    dht = DhtNode(RpcNetwork(node, config.request_timeout), node.peer_id.key, node.identity.sign,
                  addrs=node.advertised_addresses, db=db, config=config,
                  server_mode=_wants_server(node))
    for method in METHODS:
        node.rpc.register(method, _handler(dht, method))
    return dht


def _handler(dht: DhtNode, method: str):
    async def handle(arg: object, ctx) -> dict:
        """Answer a DHT request from the connection's authenticated peer."""
        try:
            return await dht.handle(ctx.peer.key, method, arg)
        except Refused as exc:
            raise (ResourceExhausted if isinstance(exc, RateLimited) else InvalidArgument)(str(exc)) from None

    return handle


async def run_dht(node: "Node", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``node.dht`` until cancelled: its timers, its role, and joining the network."""
    async with trio.open_nursery() as nursery:
        await nursery.start(node.dht.run)
        if node.config.dht.mode == "auto":
            nursery.start_soon(_follow_reachability, node)
        nursery.start_soon(_join, node)
        task_status.started()


def _wants_server(node: "Node") -> bool:
    """The configured role; "auto" is a server unless AutoNAT found that
    strangers cannot reach us."""
    mode = node.config.dht.mode
    return node.autonat.status != "private" if mode == "auto" else mode == "server"


async def _follow_reachability(node: "Node") -> None:
    """Keep the DHT's role in step with the AutoNAT verdict ("auto" mode)."""
    while True:
        server = _wants_server(node)
        if server != node.dht.server_mode:
            node.dht.server_mode = server
            log.info("DHT %s mode: AutoNAT says %s", "server" if server else "client", node.autonat.status)
        await node.autonat.changed.park()


async def _join(node: "Node") -> None:
    """Join through the bootstrap peers and the routing table saved last time
    (without a saved table, once a bootstrap peer is connected); retry with
    backoff while the table is empty."""
    seeds = [Contact(addr.peer_id.key, (str(addr.hostport),))
             for addr in node.bootstrap if addr.peer_id != node.peer_id]
    if node.config.dht.mode == "auto" and node.configured_stun:
        # Lookups send to many peers, and a peer we sent to cannot be AutoNAT's
        # independent dial-back: let the first verdict come first.
        with trio.move_on_after(AUTONAT_WAIT):
            await node.autonat.settled.wait()
    if not seeds and not len(node.dht.table):
        return  # the first node of a network: others join through it
    delay = 0.5
    cap = node.config.peers.bootstrap_max_backoff
    while True:
        if seeds and not len(node.dht.table):
            await _any_connected(node, [PeerId(seed.public_key) for seed in seeds])
        size = await node.dht.bootstrap(seeds)
        if size:
            log.info("joined the DHT: %d contacts in the routing table", size)
            return
        log.warning("DHT bootstrap found no peers (retry in %.1f s)", delay)
        await trio.sleep(delay * random.uniform(0.8, 1.2))
        delay = min(cap, delay * 2)


async def _any_connected(node: "Node", peers: list[PeerId]) -> None:
    """Return once a connection to one of ``peers`` is up."""
    async with trio.open_nursery() as nursery:
        async def wait(peer: PeerId) -> None:
            await node.wait_connected(peer)
            nursery.cancel_scope.cancel()

        for peer in peers:
            nursery.start_soon(wait, peer)
