"""NAT mapping behaviour from STUN observations (RFC 4787 terms, RFC 5780 method).

Sans-IO: the caller asks several STUN servers (any meshd is one) from the
same local socket and hands over what each reported; this module says what
kind of mapping the NAT makes.

* No NAT: every server saw our local address.
* Endpoint-independent mapping: every server saw the same address.
* Otherwise the mapping depends on the destination.  Two servers on the same
  IP but different ports tell address-dependent (same mapping) from
  address-and-port-dependent (different mappings); servers on different IPs
  alone cannot, and the result says "endpoint-dependent".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

Address = tuple[str, int]


class Mapping(enum.Enum):
    NO_NAT = "no NAT"
    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"
    ENDPOINT_DEPENDENT = "endpoint-dependent"  # one of the two above, not told apart
    UNKNOWN = "unknown"  # fewer than two servers answered


@dataclass(frozen=True)
class MappingReport:
    """What the observations say: the behaviour, our public addresses, port preservation."""

    mapping: Mapping
    public_addresses: tuple[Address, ...]  # distinct mapped addresses, in first-seen order
    port_preserved: bool | None  # mapped port == local port, when known
    servers: int  # how many observations it rests on

    @property
    def hole_punching_works(self) -> bool | None:
        """Whether a peer learning our address from one server can reach that mapping.

        True for no NAT and endpoint-independent mapping; False when mappings
        depend on the destination; None when unknown.
        """
        if self.mapping in (Mapping.NO_NAT, Mapping.ENDPOINT_INDEPENDENT):
            return True
        if self.mapping == Mapping.UNKNOWN:
            return None
        return False


def classify_mapping(local: Address, observations: list[tuple[Address, Address]]) -> MappingReport:
    """Classify from ``(server, mapped)`` pairs, all asked from the socket bound to ``local``.

    A wildcard ``local`` host (0.0.0.0 or ::) cannot be compared with what the
    servers saw, so such a socket never reads as "no NAT".
    """
    mapped_all = [mapped for _, mapped in observations]
    distinct = tuple(dict.fromkeys(mapped_all))
    preserved = None if not mapped_all else all(port == local[1] for _, port in mapped_all)
    if len(observations) < 2:
        mapping = Mapping.UNKNOWN
    elif all(_same_as_local(local, mapped) for mapped in mapped_all):
        mapping = Mapping.NO_NAT
    elif len(distinct) == 1:
        mapping = Mapping.ENDPOINT_INDEPENDENT
    else:
        mapping = _dependent_kind(observations)
    return MappingReport(mapping, distinct, preserved, len(observations))


def _same_as_local(local: Address, mapped: Address) -> bool:
    if local[0] in ("0.0.0.0", "::"):
        return False  # we do not know which of our addresses the server saw
    return mapped == local


def _dependent_kind(observations: list[tuple[Address, Address]]) -> Mapping:
    """Tell ADM from APDM with servers that share an IP; otherwise endpoint-dependent."""
    mapped_by_ip: dict[str, list[Address]] = {}
    for (server_ip, _), mapped in observations:
        mapped_by_ip.setdefault(server_ip, []).append(mapped)
    shared = [set(mapped) for mapped in mapped_by_ip.values() if len(mapped) > 1]
    if not shared:
        return Mapping.ENDPOINT_DEPENDENT
    if any(len(mapped) > 1 for mapped in shared):
        return Mapping.ADDRESS_AND_PORT_DEPENDENT
    return Mapping.ADDRESS_DEPENDENT
