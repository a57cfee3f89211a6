"""Port mapping on the home gateway: PCP, NAT-PMP and UPnP-IGD.

When the node listens on a wildcard address and has a default IPv4 gateway,
it asks the gateway to forward a public port to its UDP port by the first
protocol that works, in the configured order (``[nat]
port_mapping_protocols``, default PCP, falling back to NAT-PMP on the same
port, then UPnP-IGD).  It renews the mapping at half the lifetime granted,
deletes it on shutdown, and offers the mapped address to peers first when
they try for a direct path.  A mapping lost at renewal (the gateway forgot
it, or stopped answering) is looked for again once, a minute later.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

import trio

from ...address import HostPort
from ...config import ConfigError
from ...transport import Endpoint
from .mapping import Lease, MappingClient, PortMapError, check_external
from .pcp import PcpClient
from .upnp import UpnpClient

log = logging.getLogger("meshd.portmap")

PROTOCOLS = ("pcp", "natpmp", "upnp")
LIFETIME = 7200
RETRY_AFTER = 60.0  # seconds between losing a mapping and looking for one again
DELETE_SECONDS = 2.0  # at most this long deleting the mapping on shutdown
ROUTE_TABLE = "/proc/net/route"


def default_gateway(route_table: str = ROUTE_TABLE) -> str | None:
    """The IPv4 default gateway from the kernel's routing table, or None."""
    try:
        with open(route_table) as table:
            next(table)
            for line in table:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000" and fields[2] != "00000000":
                    return socket.inet_ntoa(int(fields[2], 16).to_bytes(4, "little"))
    except (OSError, StopIteration, ValueError):
        pass
    return None


def renew_in(granted: int, asked: int) -> float:
    """Seconds until a mapping granted for ``granted`` s is renewed: half of it
    (at least 1 s); a permanent one (0) is refreshed at half of ``asked``."""
    return max((granted or asked) / 2, 1.0)


class PortMapper:
    """Keeps one mapping of the endpoint's UDP port on the default gateway while it runs."""

    def __init__(self, endpoint: Endpoint, protocols: Sequence[str] = PROTOCOLS, lifetime: int = LIFETIME):
        unknown = [p for p in protocols if p not in PROTOCOLS]
        if unknown or not protocols:
            raise ConfigError(f"nat.port_mapping_protocols: choose from {', '.join(PROTOCOLS)}, "
                              f"not {protocols!r}")
        if not 1 <= lifetime <= 2**31 - 1:
            raise ConfigError(f"nat.port_mapping_lifetime must be 1 s or more, not {lifetime}")
        self._endpoint = endpoint
        self._protocols = list(dict.fromkeys(protocols))
        self._lifetime = lifetime
        self.gateway: str | None = None
        self.mapped: HostPort | None = None
        self.lifetime = 0
        self.protocol: str | None = None

    def status(self) -> dict | None:
        if self.mapped is None:
            return None
        return {"gateway": self.gateway, "external": str(self.mapped), "lifetime": self.lifetime,
                "protocol": self.protocol}

    async def run(self) -> None:
        """Map, renew until cancelled, then delete the mapping (shielded, bounded)."""
        self.gateway = default_gateway()
        if self.gateway is None:
            return
        held = None
        try:
            while True:
                held, lease = await self._first_mapping()
                if held is None:
                    return
                await self._keep(held, lease)
                self.mapped = None
                await trio.sleep(RETRY_AFTER)
        finally:
            if held is not None and self.mapped is not None:
                await self._delete(held)
            self.mapped = None

    def _clients(self) -> list[MappingClient]:
        """One client per protocol in the configured order (PCP and NAT-PMP share one)."""
        port = self._endpoint.local_address[1]
        clients: list[MappingClient] = []
        for name in self._protocols:
            if name == "upnp":
                clients.append(UpnpClient(self.gateway, port))
            elif not any(isinstance(c, PcpClient) for c in clients):
                clients.append(PcpClient(self.gateway, port, use_pcp="pcp" in self._protocols,
                                         use_natpmp="natpmp" in self._protocols))
        return clients

    async def _first_mapping(self) -> tuple[MappingClient | None, Lease | None]:
        """The first client that maps our port to a public address, and its lease."""
        for client in self._clients():
            try:
                lease = await client.map(self._lifetime)
            except PortMapError as exc:
                log.info("no port mapping from %s by %s: %s", self.gateway, client.name, exc)
                continue
            try:
                check_external(lease.external.host)
            except PortMapError as exc:
                log.info("port mapping by %s not used: %s", client.name, exc)
                await self._delete(client)
                continue
            return client, lease
        return None, None

    async def _keep(self, client: MappingClient, lease: Lease) -> None:
        """Hold the mapping, renewing it; returns when a renewal fails."""
        port = self._endpoint.local_address[1]
        while True:
            if lease.external != self.mapped or client.name != self.protocol:
                log.info("gateway %s maps %s to our port %d by %s", self.gateway, lease.external, port,
                         client.name)
            self.mapped, self.lifetime, self.protocol = lease.external, lease.lifetime, client.name
            await trio.sleep(renew_in(lease.lifetime, self._lifetime))
            try:
                lease = await client.map(self._lifetime)
            except PortMapError as exc:
                log.info("lost the port mapping %s (%s): %s", self.mapped, client.name, exc)
                return

    async def _delete(self, client: MappingClient) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(DELETE_SECONDS):
            try:
                await client.unmap()
                log.info("deleted the port mapping at %s (%s)", self.gateway, client.name)
            except PortMapError as exc:
                log.info("could not delete the port mapping at %s: %s", self.gateway, exc)
