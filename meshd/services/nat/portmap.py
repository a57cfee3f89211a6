"""Port mapping on the home gateway with NAT-PMP (RFC 6886).

When the node listens on a wildcard address and has a default IPv4 gateway,
it asks the gateway to forward a public port to its UDP port, renews the
mapping at half its lifetime, and deletes it on shutdown.  The mapped address
is offered to peers first when they try for a direct path.  A gateway that
does not answer (or answers port unreachable) means no mapping, quickly.
"""

from __future__ import annotations

import logging
import socket

import trio

from nat import natpmp

from ...address import HostPort
from ...transport import Endpoint

log = logging.getLogger("meshd.portmap")

LIFETIME = 7200
TRIES = 4  # 0.25 + 0.5 + 1 + 2 s, RFC 6886's schedule cut short
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


class PortMapper:
    """Keeps one NAT-PMP mapping for the endpoint's UDP port while it runs."""

    def __init__(self, endpoint: Endpoint):
        self._endpoint = endpoint
        self.gateway: str | None = None
        self.mapped: HostPort | None = None
        self.lifetime = 0

    def status(self) -> dict | None:
        if self.mapped is None:
            return None
        return {"gateway": self.gateway, "external": str(self.mapped), "lifetime": self.lifetime}

    async def run(self) -> None:
        """Map, renew until cancelled, then delete the mapping (shielded, bounded)."""
        self.gateway = default_gateway()
        if self.gateway is None:
            return
        port = self._endpoint.local_address[1]
        try:
            while True:
                try:
                    external = natpmp.parse_external_address(await self._ask(natpmp.external_address_request()))
                    granted = natpmp.parse_map_udp(
                        await self._ask(natpmp.map_udp_request(port, port, LIFETIME)))
                except natpmp.NatPmpError as exc:
                    log.info("no port mapping from %s: %s", self.gateway, exc)
                    self.mapped = None
                    return
                self.mapped, self.lifetime = HostPort(external, granted.external_port), granted.lifetime
                log.info("gateway %s maps %s to our port %d for %d s", self.gateway, self.mapped, port,
                         granted.lifetime)
                await trio.sleep(max(granted.lifetime / 2, 1))
        finally:
            if self.mapped is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await self._ask(natpmp.map_udp_request(port, 0, 0))
                        log.info("deleted the port mapping at %s", self.gateway)
                    except natpmp.NatPmpError:
                        pass
                self.mapped = None

    async def _ask(self, request: bytes) -> bytes:
        """Send ``request`` to the gateway with retransmission; its answer, or NatPmpError."""
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with sock:
            await sock.connect((self.gateway, natpmp.PORT))
            wait = 0.25
            for _ in range(TRIES):
                await sock.send(request)
                with trio.move_on_after(wait):
                    try:
                        return await sock.recv(64)
                    except ConnectionRefusedError:
                        raise natpmp.NatPmpError("the gateway runs no NAT-PMP service") from None
                wait *= 2
        raise natpmp.NatPmpError(f"no NAT-PMP answer from {self.gateway}")
