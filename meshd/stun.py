"""STUN on the node's one UDP socket: answer Binding requests, ask others for ours.

Every node answers Binding requests on its QUIC port, so any reachable peer
is a STUN server for the others; ``nat.stun_servers`` in the config adds
external ones (coturn, a public server).  Requests leave from the QUIC socket,
so the reflexive address learned is the NAT mapping QUIC uses.
"""

from __future__ import annotations

import logging

import trio

from nat.stun_client import StunClient, StunFailure
from nat.stun_server import answer

from .address import HostPort
from .transport import DialError, Endpoint

log = logging.getLogger("meshd.stun")


def _plain(addr: tuple) -> tuple[str, int]:
    """(host, port) with an IPv4-mapped IPv6 host turned back into IPv4."""
    host = addr[0]
    return (host[7:] if host.startswith("::ffff:") else host), addr[1]


class NodeStun:
    """The STUN server and client of one endpoint, and what the client learned."""

    def __init__(self, endpoint: Endpoint):
        self._endpoint = endpoint
        self.client = StunClient(endpoint.send_datagram)
        self.reflexive: dict[str, str] = {}  # server HOST:PORT -> our HOST:PORT as it saw us
        endpoint.stun_hook = self._datagram_received

    def _datagram_received(self, data: bytes, source: tuple) -> None:
        if self.client.datagram_received(data, source):
            return
        reply = answer(data, _plain(source))
        if reply is None:
            self._endpoint.stats["stun_ignored"] += 1
        else:
            self._endpoint.send_datagram(reply, source)
            self._endpoint.stats["stun_answered"] += 1

    async def query(self, server: HostPort, timeout: float = 10.0) -> str:
        """Our reflexive address as ``server`` sees it (HOST:PORT), remembered.

        Raises StunFailure if the server does not answer in ``timeout`` seconds
        or answers with an error.
        """
        target = await self._endpoint.resolve(server.host, server.port)  # DialError if it cannot
        with trio.move_on_after(timeout):
            host, port = _plain(await self.client.binding(target))
            mapped = str(HostPort(host, port))
            self.reflexive[str(server)] = mapped
            return mapped
        raise StunFailure(f"no STUN answer from {server} within {timeout:g} s")

    async def query_all(self, servers: list[HostPort]) -> None:
        """Ask every server once, logging what each says (used at start)."""
        async def one(server: HostPort) -> None:
            try:
                log.info("STUN %s sees us at %s", server, await self.query(server))
            except (StunFailure, DialError) as exc:
                log.warning("STUN %s: %s", server, exc)

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(one, server)
