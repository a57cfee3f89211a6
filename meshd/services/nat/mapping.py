"""What the port-mapping clients (PCP / NAT-PMP, UPnP-IGD) share: their shape and errors."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Protocol

import trio

from ...address import HostPort

# where a mapped address is useless to strangers: the gateway sits behind another NAT
_NOT_PUBLIC = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                                 "100.64.0.0/10")]


class PortMapError(Exception):
    """This gateway gives no mapping by this protocol (the message says why)."""


@dataclass(frozen=True)
class Lease:
    """A mapping the gateway granted: strangers reach our port at ``external``."""

    external: HostPort
    lifetime: int  # seconds the gateway keeps it without renewal; 0: until deleted


class MappingClient(Protocol):
    """One protocol's client for one gateway and one internal UDP port."""

    name: str  # "pcp", "natpmp" or "upnp": the protocol that answered

    async def map(self, lifetime: int) -> Lease:
        """Create the mapping, or renew it if it exists; PortMapError if the gateway will not."""

    async def unmap(self) -> None:
        """Delete the mapping; PortMapError if the gateway did not confirm."""


async def local_address_toward(gateway: str) -> str:
    """Our IPv4 address on the interface that reaches ``gateway`` (no packet is
    sent); PortMapError if no route leads there."""
    try:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            await sock.connect((gateway, 9))
            return sock.getsockname()[0]
    except OSError as exc:
        raise PortMapError(f"no route to the gateway {gateway}: {exc}") from None


def check_external(address: str) -> None:
    """PortMapError unless ``address`` could be reached from the internet: not
    private or shared (RFC 1918, RFC 6598: a gateway behind another NAT),
    loopback, link-local, multicast or unspecified."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise PortMapError(f"the gateway's external address {address!r} is not an IP address") from None
    if ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified or \
            any(ip in net for net in _NOT_PUBLIC if net.version == ip.version):
        raise PortMapError(f"the gateway's external address {address} is not public (another NAT in front?)")
