"""STUN on the node's one UDP socket: answer Binding requests, ask others for ours.

Every node answers Binding requests on its QUIC port, so any reachable peer
is a STUN server for the others; ``nat.stun_servers`` in the config adds
external ones (coturn, a public server).  Requests leave from the QUIC socket,
so the reflexive address learned is the NAT mapping QUIC uses.
"""

from __future__ import annotations

import logging
import socket

import trio

from nat.behaviour import Mapping, MappingReport, classify_mapping
from nat.stun_client import StunClient, StunFailure
from nat.stun_server import answer

from ...address import HostPort, plain_address
from ...transport import DialError, Endpoint

log = logging.getLogger("meshd.stun")

HAIRPIN_WAIT = 1.0  # seconds; an answer to ourselves comes back at once or not at all
RECENT_CLIENT = 180.0  # seconds a NAT may keep a filter entry open after a STUN exchange
_MAX_CLIENTS = 4096


class NodeStun:
    """The STUN server and client of one endpoint, and what the client learned."""

    def __init__(self, endpoint: Endpoint):
        self._endpoint = endpoint
        self.client = StunClient(endpoint.send_datagram)
        self.reflexive: dict[str, str] = {}  # server HOST:PORT -> our HOST:PORT as it saw us
        self.mapping: MappingReport | None = None
        self.hairpinning: bool | None = None  # can we reach our own public address?
        self.address_changed = trio.lowlevel.ParkingLot()  # woken by a new reflexive address
        self._recent_clients: dict[tuple[str, int], float] = {}  # STUN clients we answered, when
        endpoint.stun_hook = self._datagram_received

    def _datagram_received(self, data: bytes, source: tuple) -> None:
        if self.client.datagram_received(data, source):
            return
        reply = answer(data, plain_address(source))
        if reply is None:
            self._endpoint.stats["stun_ignored"] += 1
        else:
            self._endpoint.send_datagram(reply, source)
            self._endpoint.stats["stun_answered"] += 1
            self._remember_client(plain_address(source))

    def _remember_client(self, address: tuple[str, int]) -> None:
        if len(self._recent_clients) >= _MAX_CLIENTS:
            self._recent_clients.pop(next(iter(self._recent_clients)))
        self._recent_clients.pop(address, None)
        self._recent_clients[address] = trio.current_time()

    def asked_recently(self, address: tuple[str, int]) -> bool:
        """Whether ``address`` sent us a STUN request lately (its NAT would let us in)."""
        when = self._recent_clients.get(address)
        return when is not None and trio.current_time() - when < RECENT_CLIENT

    async def query(self, server: HostPort, timeout: float = 10.0) -> str:
        """Our reflexive address as ``server`` sees it (HOST:PORT), remembered.

        Raises StunFailure if the server does not answer in ``timeout`` seconds
        or answers with an error.
        """
        target = await self._endpoint.resolve(server.host, server.port)  # DialError if it cannot
        with trio.move_on_after(timeout):
            host, port = plain_address(await self.client.binding(target))
            mapped = str(HostPort(host, port))
            if mapped not in self.reflexive.values():
                self.address_changed.unpark_all()  # a public address we had not seen
            self.reflexive[str(server)] = mapped
            return mapped
        raise StunFailure(f"no STUN answer from {server} within {timeout:g} s")

    async def discover(self, servers: list[HostPort], timeout: float = 10.0) -> MappingReport:
        """Ask every server at once and classify the NAT's mapping from the answers.

        Servers that fail are logged and left out; the report says how many
        answered.  Any meshd's listen address is a STUN server.
        """
        observations: list[tuple[tuple[str, int], tuple[str, int]]] = []

        async def one(server: HostPort) -> None:
            try:
                mapped = HostPort.parse(await self.query(server, timeout))
            except (StunFailure, DialError) as exc:
                log.warning("STUN %s: %s", server, exc)
                return
            log.info("STUN %s sees us at %s", server, mapped)
            observations.append(((server.host, server.port), (mapped.host, mapped.port)))

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(one, server)
        self.mapping = classify_mapping(self._local_address(servers), observations)
        if self.mapping.mapping != Mapping.NO_NAT and self.mapping.public_addresses:
            await self._check_hairpinning(self.mapping.public_addresses[0])
        return self.mapping

    async def _check_hairpinning(self, public: tuple[str, int]) -> None:
        """Send a Binding request to our own public address: does the NAT turn it back in?"""
        try:
            target = await self._endpoint.resolve(*public)
        except DialError:
            return
        with trio.move_on_after(HAIRPIN_WAIT):
            await self.client.binding(target)
            self.hairpinning = True
            return
        self.hairpinning = False

    def _local_address(self, servers: list[HostPort]) -> tuple[str, int]:
        """Our socket's address; for a wildcard bind, the source IP the route to a server uses."""
        host, port = self._endpoint.local_address
        if host in ("0.0.0.0", "::") and servers:
            probe = socket.socket(self._endpoint.family, socket.SOCK_DGRAM)
            try:
                probe.connect((servers[0].host, servers[0].port))  # picks a route; sends nothing
                host = plain_address(probe.getsockname())[0]
            except OSError:
                pass
            finally:
                probe.close()
        return host, port
