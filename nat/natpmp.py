"""NAT-PMP (RFC 6886) messages, with no I/O: port mappings on a home gateway.

Clients send requests to their default gateway's UDP port 5351 and retry on
the RFC's schedule (250 ms, doubling) a bounded number of times.  Only what
meshd needs is here, both sides of it: the gateway's external address, and
UDP mappings (lifetime 0 deletes one).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

PORT = 5351
VERSION = 0
OP_EXTERNAL_ADDRESS = 0
OP_MAP_UDP = 1
RESPONSE = 128
SUCCESS, UNSUPPORTED_VERSION, REFUSED, NETWORK_FAILURE, OUT_OF_RESOURCES, UNSUPPORTED_OPCODE = range(6)
RESULTS = {
    SUCCESS: "success", UNSUPPORTED_VERSION: "unsupported version",
    REFUSED: "not authorized or refused", NETWORK_FAILURE: "network failure",
    OUT_OF_RESOURCES: "out of resources", UNSUPPORTED_OPCODE: "unsupported opcode",
}


class NatPmpError(ValueError):
    """A malformed message, or the gateway's refusal (with its result text)."""


@dataclass(frozen=True)
class Mapping:
    internal_port: int
    external_port: int
    lifetime: int  # seconds; 0 deletes
    epoch: int = 0  # seconds since the gateway's mapping table started (answers only)


# --- requests (client) and their parsing (gateway) ------------------------------


def external_address_request() -> bytes:
    return struct.pack(">BB", VERSION, OP_EXTERNAL_ADDRESS)


def map_udp_request(internal_port: int, external_port: int, lifetime: int) -> bytes:
    """Ask for ``internal_port`` to be reachable at ``external_port`` (a hint) for ``lifetime`` s."""
    for name, value, top in (("internal port", internal_port, 65535),
                             ("external port", external_port, 65535), ("lifetime", lifetime, 2**32 - 1)):
        if not 0 <= value <= top:
            raise ValueError(f"{name} {value} is out of range")
    return struct.pack(">BBHHHI", VERSION, OP_MAP_UDP, 0, internal_port, external_port, lifetime)


def parse_request(data: bytes) -> tuple[int, Mapping | None]:
    """``(opcode, mapping)`` of a client's request (mapping None for the address request)."""
    if len(data) < 2 or data[0] != VERSION:
        raise NatPmpError("not a NAT-PMP version 0 request")
    opcode = data[1]
    if opcode == OP_EXTERNAL_ADDRESS and len(data) == 2:
        return opcode, None
    if opcode == OP_MAP_UDP and len(data) == 12:
        _, _, _, internal, external, lifetime = struct.unpack(">BBHHHI", data)
        return opcode, Mapping(internal, external, lifetime)
    raise NatPmpError(f"unsupported or malformed request (opcode {opcode}, {len(data)} bytes)")


# --- answers (gateway) and their parsing (client) -------------------------------


def unsupported_version_response(epoch: int, opcode: int) -> bytes:
    """RFC 6886 section 3.5: the answer to a request of another version (a PCP
    client's, say), which tells the client to speak NAT-PMP."""
    return struct.pack(">BBHI", VERSION, RESPONSE | (opcode & 0x7F), UNSUPPORTED_VERSION, epoch)


def external_address_response(epoch: int, address: str, result: int = SUCCESS) -> bytes:
    return struct.pack(">BBHI", VERSION, RESPONSE + OP_EXTERNAL_ADDRESS, result, epoch) + \
        ipaddress.IPv4Address(address).packed


def map_udp_response(epoch: int, mapping: Mapping, result: int = SUCCESS) -> bytes:
    return struct.pack(">BBHIHHI", VERSION, RESPONSE + OP_MAP_UDP, result, epoch,
                       mapping.internal_port, mapping.external_port, mapping.lifetime)


def _header(data: bytes, opcode: int, size: int) -> int:
    if len(data) < 4:
        raise NatPmpError(f"NAT-PMP answer of {len(data)} bytes is too short")
    version, op, result = struct.unpack_from(">BBH", data)
    if version != VERSION or op != RESPONSE + opcode:
        raise NatPmpError(f"not an answer to opcode {opcode} (version {version}, opcode {op})")
    if result != SUCCESS:
        raise NatPmpError(f"gateway refused: {RESULTS.get(result, f'result {result}')}")
    if len(data) != size:
        raise NatPmpError(f"NAT-PMP answer has {len(data)} bytes, expected {size}")
    return struct.unpack_from(">I", data, 4)[0]


def parse_external_address(data: bytes) -> str:
    """The gateway's external IPv4 address from its answer."""
    _header(data, OP_EXTERNAL_ADDRESS, 12)
    return str(ipaddress.IPv4Address(data[8:12]))


def parse_map_udp(data: bytes) -> Mapping:
    """The mapping the gateway granted (external port and lifetime may differ from the request)."""
    epoch = _header(data, OP_MAP_UDP, 16)
    internal, external, lifetime = struct.unpack_from(">HHI", data, 8)
    return Mapping(internal, external, lifetime, epoch)
