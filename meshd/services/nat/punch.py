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

Public addresses come from STUN (``NodeStun``): the reflexive addresses
peers and servers reported.  Behind a symmetric NAT those do not predict the
mapping used towards a new peer, and punching fails, as expected.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from nat.behaviour import Mapping
from nat.stun import binding_request

from ...address import AddressError, HostPort
from ...identity import PeerId
from ...rpc import InvalidArgument, RpcError
from ...service import Host
from ...transport import DialError, PeerConnection
from .portmap import PortMapper
from .portprobe import HARD, PortProber
from .stun import NodeStun

log = logging.getLogger("meshd.punch")

BURST = 10  # packets per address
BURST_GAP = 0.02  # seconds between them
TRIES = 3
DIAL_TIMEOUT = 3.0
_MAX_ADDRS = 8


class HolePuncher:
    """Both roles of hole punching on one node."""

    def __init__(self, host: Host, stun: NodeStun, portmap: PortMapper,
                 stun_servers: Callable[[], list[HostPort]]):
        self._node = host
        self._stun = stun
        self._portmap = portmap
        self._stun_servers = stun_servers
        self._prober = PortProber(host, stun)

    def rpc_methods(self) -> dict:
        return {"punch.exchange": self._serve_exchange, **self._prober.rpc_methods()}

    def public_addresses(self) -> list[str]:
        """Where others may reach our socket: STUN's reflexive addresses, then our listen address."""
        mapped = self._portmap.mapped
        seen = ([str(mapped)] if mapped else []) + list(self._stun.reflexive.values())
        seen = list(dict.fromkeys(seen))
        listen = str(self._node.listen_address)
        if not listen.startswith(("0.0.0.0", "[::]")):
            seen.append(listen)
        return seen[:_MAX_ADDRS]

    async def _serve_exchange(self, arg: object, ctx) -> dict:
        # Only peers we reach through a relay may ask, so a burst (at most
        # BURST x _MAX_ADDRS packets) is never aimed at a stranger's behalf.
        if ctx.info.get("path") != "relayed":
            raise InvalidArgument("hole punching is asked for over a relayed connection")
        theirs = _addresses(arg)
        self._node.spawn(self._attempt, ctx.peer, theirs)
        return {"addrs": self.public_addresses(), "mapping": self._prober.my_mapping().value}

    async def punch(self, peer: PeerId) -> PeerConnection | None:
        """Try to replace the relayed connection to ``peer`` with a direct one.

        The two sides' mapping kinds choose the method: crossing bursts and
        dials when at most one side is symmetric and the other has no NAT (or
        neither is symmetric), port-prediction probing when a symmetric NAT
        meets an endpoint-independent one, nothing when both are symmetric.
        Returns the direct connection (path "punched"), or None.
        """
        if not self._stun.reflexive:
            await self._stun.discover(self._stun_servers())
        for attempt in range(1, TRIES + 1):
            start = trio.current_time()
            try:
                reply = await self._node.rpc.call(
                    peer, "punch.exchange", {"addrs": self.public_addresses()}, timeout=10
                )
            except RpcError as exc:
                log.info("punch %s: exchange failed: %s", peer, exc)
                return None
            theirs = _addresses(reply)
            method = _method(self._prober.my_mapping(), _mapping(reply))
            if method is None or not theirs:
                log.info("punch %s: both sides symmetric (or no address): staying relayed", peer)
                return None
            if method == "probe":
                return await self._prober.run(peer, _mapping(reply), theirs[0])
            await trio.sleep((trio.current_time() - start) / 2)  # N began when it answered
            conn = await self._attempt(peer, theirs)
            if conn is not None:
                conn.path = "punched"
            current = self._node.live(peer)
            if current is not None and current.path != "relayed":
                return current  # ours, or N's dial towards us if the two crossed
            log.info("punch %s: try %d of %d failed", peer, attempt, TRIES)
        return None

    async def _attempt(self, peer: PeerId, addresses: list[HostPort]) -> PeerConnection | None:
        """Burst towards ``addresses`` while dialing each in turn; the first direct connection wins.

        Both sides run this, so whichever NAT lets the other in first decides,
        and a public peer is reached whatever NAT the other side has.
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
                for hostport in addresses:
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
        for _ in range(BURST):
            for target in targets:
                endpoint.send_datagram(binding_request().encode(), target)
            await trio.sleep(BURST_GAP)


def _mapping(reply: object) -> Mapping:
    try:
        return Mapping(reply.get("mapping")) if isinstance(reply, dict) else Mapping.UNKNOWN
    except ValueError:
        return Mapping.UNKNOWN


def _method(mine: Mapping, theirs: Mapping) -> str | None:
    """"punch", "probe", or None (no method can work) for these two mapping kinds."""
    hard = (mine in HARD) + (theirs in HARD)
    if hard == 2:
        return None
    if hard == 1 and Mapping.ENDPOINT_INDEPENDENT in (mine, theirs):
        return "probe"
    return "punch"


def _addresses(arg: object) -> list[HostPort]:
    if not isinstance(arg, dict) or not isinstance(arg.get("addrs"), list):
        raise InvalidArgument('expected {"addrs": [HOST:PORT, ...]}')
    out = []
    for text in arg["addrs"][:_MAX_ADDRS]:
        try:
            out.append(HostPort.parse(text))
        except (AddressError, TypeError, AttributeError):
            raise InvalidArgument(f"bad address {text!r}") from None
    return out
