"""Hole punching over a relayed connection (after libp2p's DCUtR), then a direct QUIC dial.

When X reaches N only through a relay, X asks N over that relayed connection
(``punch.exchange``) for N's public addresses, sending its own.  Both sides
then send a short burst of STUN Binding requests from their one UDP socket to
the other's addresses: each burst opens the sender's NAT towards the other
(and, behind an endpoint-independent mapping, reuses the very port QUIC uses).
N starts as soon as it answers; X starts when the answer arrives, half a
round trip later, so the bursts cross.  X then dials N directly.  On success
the direct connection, with path "punched", replaces the relayed one for new
calls (the node keeps one connection per peer).  N dials X's addresses too, so a
public X is reached whatever NAT N is behind.  Bounded tries; the relay stays
the fallback (reserved, and dialed again if the direct path dies).

Both sides also offer their host candidates (``"local"``: their interface
addresses with their QUIC port, :mod:`nat.candidates`), and dial the other's
alongside its public addresses, with no burst (no NAT between them): two
machines behind one NAT that does not hairpin find each other only so.  They
are tried even when no NAT method can work (both sides symmetric).  All
dials run at once and the first handshake to complete wins, so of several
working paths the one with the lowest round trip is kept.

Public addresses come from STUN (``NodeStun``): the reflexive addresses
peers and servers reported.  The method, the addresses and the burst schedule
are :mod:`nat.punch`'s; this module does the I/O.  Behind a symmetric NAT those do not predict the
mapping used towards a new peer, and punching fails, as expected.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from nat.candidates import dialable, host_candidates, ip_literal, take_candidates
from nat.portprobe import relayed_only
from nat.punch import (DIAL_TIMEOUT, TRIES, burst, choose_method, mapping_of, parse_addresses,
                       public_addresses, wait_before_dial)
from nat.stun import binding_request

from ...address import HostPort
from ...identity import PeerId
from ...rpc import RpcError
from ...service import Host
from ...transport import DialError, PeerConnection
from .errors import bad_reply, parse_hostport, rpc_errors
from .interfaces import interface_addresses
from .portmap import PortMapper
from .portprobe import PortProber
from .stun import NodeStun

log = logging.getLogger("meshd.punch")


class HolePuncher:
    """Both roles of hole punching on one node."""

    def __init__(self, host: Host, stun: NodeStun, portmap: PortMapper,
                 stun_servers: Callable[[], list[HostPort]], *, offer_local: bool = True):
        self._node = host
        self._stun = stun
        self._portmap = portmap
        self._stun_servers = stun_servers
        self._offer_local = offer_local
        self._prober = PortProber(host, stun)

    def rpc_methods(self) -> dict:
        return {"punch.exchange": self._serve_exchange, **self._prober.rpc_methods()}

    def public_addresses(self) -> list[str]:
        """Where others may reach our socket: port mapping, STUN's reflexive addresses, listen address."""
        mapped = self._portmap.mapped
        return public_addresses(str(mapped) if mapped else None, self._stun.reflexive.values(),
                                str(self._node.listen_address))

    def local_addresses(self) -> list[str]:
        """Our host candidates: interface addresses with our port, when we listen on a
        wildcard address (a specific one is among :meth:`public_addresses` already)."""
        listen = self._node.listen_address
        if not self._offer_local or listen.host not in ("0.0.0.0", "::"):
            return []
        return host_candidates(interface_addresses(), listen.port, ipv6=listen.host == "::")

    def _exchange_message(self) -> dict:
        return {"addrs": self.public_addresses(), "local": self.local_addresses()}

    def _candidates(self, message: object) -> list[HostPort]:
        """The peer's host candidates we may dial; Malformed if the field is malformed."""
        ours = ip_literal(self._node.listen_address.host)
        on_loopback = ours is not None and ours.is_loopback
        return [hp for hp in map(parse_hostport, take_candidates(message))
                if dialable(hp.host, loopback=on_loopback)]

    async def _serve_exchange(self, arg: object, ctx) -> dict:
        # Only peers we reach through a relay may ask, so a burst (at most
        # BURST x MAX_ADDRS packets) is never aimed at a stranger's behalf.
        with rpc_errors():
            relayed_only(ctx.info.get("path"), "hole punching")
            theirs, local = _addresses(arg), self._candidates(arg)
        self._node.spawn(self._attempt, ctx.peer, theirs, local)
        return {**self._exchange_message(), "mapping": self._prober.my_mapping().value}

    async def punch(self, peer: PeerId) -> PeerConnection | None:
        """Try to replace the relayed connection to ``peer`` with a direct one.

        The two sides' mapping kinds choose the method: crossing bursts and
        dials when at most one side is symmetric and the other has no NAT (or
        neither is symmetric), port-prediction probing when a symmetric NAT
        meets an endpoint-independent one, nothing when both are symmetric.
        The peer's host candidates are dialed with the bursts, or on their own
        first when the method is not "punch".  Returns the direct connection
        (path "punched"), or None.
        """
        if not self._stun.reflexive:
            await self._stun.discover(self._stun_servers())
        for attempt in range(1, TRIES + 1):
            start = trio.current_time()
            try:
                reply = await self._node.rpc.call(peer, "punch.exchange", self._exchange_message(), timeout=10)
                with bad_reply(peer, "punch.exchange"):
                    theirs, local = _addresses(reply), self._candidates(reply)
            except RpcError as exc:
                log.info("punch %s: exchange failed: %s", peer, exc)
                return None
            method = choose_method(self._prober.my_mapping(), mapping_of(reply))
            if method != "punch" and local and (conn := await self._direct(peer, [], local)):
                return conn  # at one site: no NAT between us
            if method is None or not theirs + local:
                log.info("punch %s: both sides symmetric (or no address): staying relayed", peer)
                return None
            if method == "probe":
                return await self._prober.run(peer, mapping_of(reply), theirs[0]) if theirs else None
            await trio.sleep(wait_before_dial(start, trio.current_time()))  # N began when it answered
            conn = await self._direct(peer, theirs, local)
            if conn is not None:
                return conn
            log.info("punch %s: try %d of %d failed", peer, attempt, TRIES)
        return None

    async def _direct(self, peer: PeerId, addresses: list[HostPort],
                      local: list[HostPort]) -> PeerConnection | None:
        """:meth:`_attempt`, then the direct connection to ``peer`` in use, if any (path "punched")."""
        conn = await self._attempt(peer, addresses, local)
        if conn is not None:
            conn.path = "punched"
        current = self._node.live(peer)
        return current if current is not None and current.path != "relayed" else None  # ours, or theirs

    async def _attempt(self, peer: PeerId, addresses: list[HostPort],
                       local: list[HostPort]) -> PeerConnection | None:
        """Burst towards ``addresses`` while dialing them and the host candidates ``local``
        all at once; the first direct connection wins.

        Both sides run this, so whichever NAT lets the other in first decides,
        and a public peer is reached whatever NAT the other side has.  Host
        candidates get no burst: no NAT stands between two hosts of one LAN.
        """
        won: list[PeerConnection] = []

        async def dial(hostport: HostPort, scope: trio.CancelScope) -> None:
            conn = await self._dial(peer, hostport)
            if conn is not None:
                won.append(conn)
                log.info("punched through to %s at %s", peer, hostport)
                scope.cancel()

        async def other_side_won(scope: trio.CancelScope) -> None:
            while True:  # the peer's dial towards us may get through first
                current = self._node.live(peer)
                if current is not None and current.path != "relayed":
                    scope.cancel()
                await self._node.wait_connection_change(peer)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._burst, addresses)
            nursery.start_soon(other_side_won, nursery.cancel_scope)
            async with trio.open_nursery() as dials:
                for hostport in dict.fromkeys(addresses + local):
                    dials.start_soon(dial, hostport, dials.cancel_scope)
            nursery.cancel_scope.cancel()
        return won[0] if won else None

    async def _dial(self, peer: PeerId, hostport: HostPort) -> PeerConnection | None:
        try:
            return await self._node.endpoint.dial(hostport.host, hostport.port, peer, timeout=DIAL_TIMEOUT)
        except DialError as exc:
            log.debug("punch dial %s: %s", hostport, exc)
            return None

    async def _burst(self, addresses: list[HostPort]) -> None:
        """A few STUN Binding requests to each address, from the QUIC socket."""
        endpoint = self._node.endpoint
        targets = []
        for hostport in addresses:
            try:
                targets.append(await endpoint.resolve(hostport.host, hostport.port))
            except DialError:
                continue
        for round_targets, gap in burst(targets):
            for target in round_targets:
                endpoint.send_datagram(binding_request().encode(), target)
            await trio.sleep(gap)


def _addresses(arg: object) -> list[HostPort]:
    """The addresses of an exchange request or reply; Malformed if any is not HOST:PORT."""
    return [parse_hostport(text) for text in parse_addresses(arg)]
