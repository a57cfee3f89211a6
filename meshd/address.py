"""Peer addresses: ``PEERID@HOST:PORT`` text form (IPv6 hosts in brackets).

The PeerId is part of every address a node dials, so that a dial can only
succeed against the key it was meant for.  Host:port pairs alone are
:class:`HostPort`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .identity import PeerId, PeerIdError


class AddressError(ValueError):
    """Text that was meant to be an address is not one; the message says why."""


@dataclass(frozen=True)
class HostPort:
    """A UDP endpoint: an IP literal or host name, and a port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, *, allow_zero_port: bool = False) -> "HostPort":
        """Parse ``HOST:PORT`` or ``[V6]:PORT``."""
        text = text.strip()
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise AddressError(f"{text!r}: '[' without a closing ']'")
            host, rest = text[1:end], text[end + 1 :]
            if not rest.startswith(":"):
                raise AddressError(f"{text!r}: expected ':PORT' after ']'")
            port_text = rest[1:]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise AddressError(f"{text!r}: {host!r} in brackets is not an IPv6 address") from None
        else:
            host, sep, port_text = text.rpartition(":")
            if not sep or not host:
                raise AddressError(f"{text!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT)")
            if ":" in host:
                raise AddressError(f"{text!r}: write IPv6 addresses in brackets, [ADDR]:PORT")
        if not (port_text.isascii() and port_text.isdigit()):
            raise AddressError(f"{text!r}: port {port_text!r} is not a number")
        low = 0 if allow_zero_port else 1
        if len(port_text) > 5 or not low <= int(port_text) <= 65535:  # int() refuses over 4300 digits
            raise AddressError(f"{text!r}: port {port_text[:12]} is outside {low}-65535")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class PeerAddr:
    """Where a peer can be dialed, and which key must answer there."""

    peer_id: PeerId
    hostport: HostPort

    @classmethod
    def parse(cls, text: str) -> "PeerAddr":
        """Parse ``PEERID@HOST:PORT``; errors name the part that is wrong."""
        text = text.strip()
        peer_text, sep, rest = text.partition("@")
        if not sep:
            raise AddressError(
                f"{text!r}: expected PEERID@HOST:PORT (a node prints its own with `meshctl id`)"
            )
        try:
            peer_id = PeerId.from_string(peer_text)
        except PeerIdError as exc:
            raise AddressError(f"bad PeerId in address: {exc}") from None
        return cls(peer_id, HostPort.parse(rest))

    @property
    def host(self) -> str:
        return self.hostport.host

    @property
    def port(self) -> int:
        return self.hostport.port

    def __str__(self) -> str:
        return f"{self.peer_id}@{self.hostport}"


def plain_address(addr: tuple) -> tuple[str, int]:
    """(host, port) of a socket address, with an IPv4-mapped IPv6 host (what a
    dual-stack socket reports for IPv4 peers) turned back into IPv4."""
    host = addr[0]
    return (host[7:] if host.startswith("::ffff:") else host), addr[1]
