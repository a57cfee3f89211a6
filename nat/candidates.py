"""Host candidates: the local interface addresses two peers at one site try, with no I/O.

As ICE's host candidates: besides the public (reflexive, mapped) addresses
hole punching exchanges, each side offers the addresses of its own network
interfaces with its QUIC port (:func:`host_candidates`).  Two machines behind
one NAT that does not hairpin reach each other only this way; elsewhere the
dial simply fails.  What a peer offers is checked before anything is dialed
(:func:`take_candidates`, :func:`dialable`): at most
:data:`MAX_HOST_CANDIDATES`, IP literals only (a name would make us query
DNS on a peer's behalf), never multicast, broadcast or unspecified, and
loopback or link-local only when we listen on loopback ourselves.

Addresses here are texts (``"10.0.0.2"``, ``"10.0.0.2:4100"``); the shell
enumerates interfaces and parses ``HOST:PORT``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from .errors import Malformed

MAX_HOST_CANDIDATES = 4  # addresses offered to a peer, and taken from one
SITE_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                                                          "fc00::/7"))
"""Private networks (RFC 1918, IPv6 unique local): a site's LAN, where LAN discovery runs."""

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip_literal(text: str) -> IpAddress | None:
    """The address ``text`` spells (IPv4-mapped IPv6 as its IPv4), or None if it is not an IP literal."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def is_site_local(text: str) -> bool:
    """Whether ``text`` is an IP address of a private network (:data:`SITE_NETWORKS`)."""
    ip = ip_literal(text)
    return ip is not None and any(ip.version == net.version and ip in net for net in SITE_NETWORKS)


def dialable(host: str, *, loopback: bool) -> bool:
    """Whether a candidate's host may be dialed: an IP literal of one unicast host.

    Never a name, the unspecified address, multicast, or IPv4 broadcast;
    loopback and link-local only when ``loopback`` (we listen on loopback
    ourselves, so the peer may be on this machine).
    """
    ip = ip_literal(host)
    if ip is None or ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        return False
    return loopback or not (ip.is_loopback or ip.is_link_local)


def host_candidates(local_ips: Iterable[str], port: int, *, ipv4: bool = True,
                    ipv6: bool = False) -> list[str]:
    """The ``HOST:PORT`` texts to offer peers: our interface addresses with our port.

    Of ``local_ips`` (in interface order), those of the families asked for
    that a peer elsewhere may dial (:func:`dialable` with no loopback):
    private networks first, then the rest, without repeats, at most
    :data:`MAX_HOST_CANDIDATES`.  Anything that is not an IP literal is skipped.
    """
    usable = []
    for text in dict.fromkeys(local_ips):
        ip = ip_literal(text)
        if ip is None or not dialable(text, loopback=False) or not (ipv4 if ip.version == 4 else ipv6):
            continue
        usable.append(ip)
    usable.sort(key=lambda ip: not is_site_local(str(ip)))  # stable: interface order within each group
    return [f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}" for ip in usable][:MAX_HOST_CANDIDATES]


def take_candidates(message: object) -> list[str]:
    """The first :data:`MAX_HOST_CANDIDATES` texts of a message's ``"local"`` field.

    ``[]`` when the message has no such field (a peer that offers none);
    Malformed unless it is a list whose first entries are strings.  Whether
    each is a dialable ``HOST:PORT`` is for the caller's parser and
    :func:`dialable`.
    """
    if not isinstance(message, dict) or message.get("local") is None:
        return []
    texts = message["local"]
    if not isinstance(texts, list):
        raise Malformed('expected "local": [HOST:PORT, ...]')
    texts = texts[:MAX_HOST_CANDIDATES]
    for text in texts:
        if not isinstance(text, str):
            raise Malformed(f"bad host candidate {text!r:.40}")
    return texts
