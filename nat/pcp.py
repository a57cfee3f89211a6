"""PCP (RFC 6887) MAP requests and answers, with no I/O: the client side.

PCP is NAT-PMP's successor and shares its port (5351) on the gateway.  A
client sends a MAP request naming its own address, a random 96-bit nonce, the
protocol and internal port, and a suggested external port and lifetime; the
answer carries the external address and port the gateway assigned and the
lifetime it granted.  The same request with the same nonce renews the
mapping; lifetime 0 deletes it.

Version negotiation (RFC 6887 section 9 and appendix A): a gateway that only
speaks NAT-PMP answers a PCP request with NAT-PMP's "unsupported version"
(version 0, result 1), and a PCP server that speaks an older PCP answers
UNSUPP_VERSION naming its version; both raise :class:`UnsupportedVersion`,
after which the client uses :mod:`nat.natpmp` on the same port.

Datagrams that are not a valid answer to the request in hand (too short,
too long, not a multiple of 4 bytes, not a response, another opcode, another
nonce, protocol or internal port: section 8.3 and 11.3) raise
:class:`nat.errors.Malformed`; the client ignores them and keeps waiting.
"""

from __future__ import annotations

import ipaddress
import secrets
import struct
from dataclasses import dataclass

from .errors import Malformed

PORT = 5351
VERSION = 2
OP_MAP = 1
RESPONSE_BIT = 0x80
PROTOCOL_UDP = 17
NONCE_SIZE = 12
HEADER_SIZE = 24
MAP_SIZE = 36
MAX_MESSAGE_SIZE = 1100
NATPMP_UNSUPPORTED_VERSION = 1  # NAT-PMP's result code, in a version-0 answer

SUCCESS, UNSUPP_VERSION = 0, 1
RESULTS = {
    0: "success", 1: "unsupported version", 2: "not authorized", 3: "malformed request",
    4: "unsupported opcode", 5: "unsupported option", 6: "malformed option", 7: "network failure",
    8: "no resources", 9: "unsupported protocol", 10: "user exceeded quota",
    11: "cannot provide the external address or port", 12: "address mismatch",
    13: "excessive remote peers",
}

_HEADER = struct.Struct(">BBHI16s")  # version, R|opcode, reserved, lifetime, client address
_RESPONSE_HEADER = struct.Struct(">BBBBII12x")  # version, R|opcode, reserved, result, lifetime, epoch
_MAP = struct.Struct(">12sB3xHH16s")  # nonce, protocol, internal port, external port, external address


class PcpError(Exception):
    """The gateway answered with a result other than success.

    ``result`` is its code (:data:`RESULTS` names it); ``lifetime`` is how
    many seconds the gateway says the condition will last.
    """

    def __init__(self, result: int, lifetime: int):
        super().__init__(f"gateway refused: {RESULTS.get(result, f'result {result}')}")
        self.result = result
        self.lifetime = lifetime


class UnsupportedVersion(PcpError):
    """The gateway does not speak PCP version 2; ``version`` is the one it speaks (0: NAT-PMP)."""

    def __init__(self, version: int, lifetime: int = 0):
        super().__init__(UNSUPP_VERSION, lifetime)
        self.version = version


@dataclass(frozen=True)
class MapRequest:
    """One mapping as the client asks for it; keep it to renew (same nonce) or delete."""

    client_address: str  # our address as the gateway sees the packet's source
    internal_port: int
    external_port: int = 0  # a suggestion; 0 for none
    nonce: bytes = b""  # 12 bytes; a fresh random one when left empty
    protocol: int = PROTOCOL_UDP

    def __post_init__(self) -> None:
        if not self.nonce:
            object.__setattr__(self, "nonce", secrets.token_bytes(NONCE_SIZE))
        if len(self.nonce) != NONCE_SIZE:
            raise ValueError(f"a PCP nonce has {NONCE_SIZE} bytes, not {len(self.nonce)}")
        for name, value, top in (("internal port", self.internal_port, 65535),
                                 ("external port", self.external_port, 65535), ("protocol", self.protocol, 255)):
            if not 0 <= value <= top:
                raise ValueError(f"{name} {value} is out of range")
        if self.internal_port == 0:
            raise ValueError("internal port 0 means all ports; PCP MAP needs one port")
        _address_bytes(self.client_address)  # raises ValueError if it is not an IP literal

    def encode(self, lifetime: int) -> bytes:
        """The MAP request asking for ``lifetime`` seconds (0 deletes the mapping)."""
        if not 0 <= lifetime <= 2**32 - 1:
            raise ValueError(f"lifetime {lifetime} is out of range")
        header = _HEADER.pack(VERSION, OP_MAP, 0, lifetime, _address_bytes(self.client_address))
        unspecified = _address_bytes("0.0.0.0" if _is_v4(self.client_address) else "::")
        return header + _MAP.pack(self.nonce, self.protocol, self.internal_port, self.external_port, unspecified)


@dataclass(frozen=True)
class MapResult:
    """What the gateway granted: the mapping's public side, for ``lifetime`` seconds."""

    external_address: str
    external_port: int
    lifetime: int
    epoch: int  # seconds since the gateway's mapping state began (see Epoch)


def parse_map_response(data: bytes, request: MapRequest) -> MapResult:
    """The gateway's answer to ``request``.

    Raises :class:`UnsupportedVersion` (fall back to NAT-PMP),
    :class:`PcpError` for any other refusal, and
    :class:`~nat.errors.Malformed` for a datagram that is not an answer to
    this request (ignore it).
    """
    if len(data) >= 4 and data[0] == 0:
        if struct.unpack_from(">H", data, 2)[0] != NATPMP_UNSUPPORTED_VERSION:
            raise Malformed("a NAT-PMP answer to a PCP request that is not 'unsupported version'")
        raise UnsupportedVersion(0)
    if len(data) < HEADER_SIZE or len(data) > MAX_MESSAGE_SIZE or len(data) % 4:
        raise Malformed(f"a PCP answer of {len(data)} bytes (24 to 1100, a multiple of 4)")
    version, op, _, result, lifetime, epoch = _RESPONSE_HEADER.unpack_from(data)
    if not op & RESPONSE_BIT or op & ~RESPONSE_BIT != OP_MAP:
        raise Malformed(f"not an answer to a MAP request (opcode byte 0x{op:02x})")
    if version != VERSION:
        if result == UNSUPP_VERSION:
            raise UnsupportedVersion(version, lifetime)
        raise Malformed(f"a PCP version {version} answer")
    if len(data) < HEADER_SIZE + MAP_SIZE:
        if result != SUCCESS:  # RFC 6887 section 7.2: an error may come without the opcode's data
            raise PcpError(result, lifetime)
        raise Malformed(f"a MAP answer of {len(data)} bytes has no room for the MAP data")
    nonce, protocol, internal, external, address = _MAP.unpack_from(data, HEADER_SIZE)
    if (nonce, protocol, internal) != (request.nonce, request.protocol, request.internal_port):
        raise Malformed("a MAP answer for another mapping (nonce, protocol or port differ)")
    _check_options(data, HEADER_SIZE + MAP_SIZE)
    if result != SUCCESS:
        raise PcpError(result, lifetime)
    if lifetime and (external == 0 or _address_text(address) in ("0.0.0.0", "::")):
        raise Malformed("a successful MAP answer without an external address and port")
    return MapResult(_address_text(address), external, lifetime, epoch)


def _check_options(data: bytes, offset: int) -> None:
    """Refuse a malformed options area (each option: code, reserved, length, data padded to 4)."""
    while offset < len(data):
        if len(data) - offset < 4:
            raise Malformed("a truncated PCP option header")
        length = struct.unpack_from(">H", data, offset + 2)[0]
        offset += 4 + (length + 3) // 4 * 4
        if offset > len(data):
            raise Malformed("a PCP option runs past the end of the message")


class Epoch:
    """Tells from a gateway's epoch times whether it lost its mappings (RFC 6887 section 8.5).

    NAT-PMP's epoch (RFC 6886 section 3.6) follows the same rule.  A
    gateway that restarted has forgotten every mapping; its clients must map
    again at once.
    """

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None  # (our clock, the gateway's epoch)

    def lost_state(self, epoch: int, now: float) -> bool:
        """Record an answer's ``epoch`` seen at ``now`` (seconds, our monotonic
        clock); True if the gateway lost its state since the previous answer."""
        last, self._last = self._last, (now, epoch)
        if last is None:
            return False
        client_delta, server_delta = now - last[0], epoch - last[1]
        if epoch < last[1] - 1:
            return True
        return client_delta + 2 < server_delta - server_delta / 16 or \
            server_delta + 2 < client_delta - client_delta / 16


def _is_v4(address: str) -> bool:
    return ipaddress.ip_address(address).version == 4


def _address_bytes(address: str) -> bytes:
    """16 bytes: an IPv6 address, or an IPv4 one mapped into IPv6 (::ffff:a.b.c.d)."""
    ip = ipaddress.ip_address(address)
    return ip.packed if ip.version == 6 else ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed).packed


def _address_text(packed: bytes) -> str:
    ip = ipaddress.IPv6Address(packed)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else str(ip)
